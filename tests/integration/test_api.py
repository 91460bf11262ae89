"""The OpenAI-compatible API on the real default model, driven by the official ``openai`` package.

One coordinator (one ONNX node agent process) runs with two API servers in its event loop, on a
background thread: an open one and one that requires an API key. The tests talk HTTP to them
like any client and read the coordinator's events to see what happened on the cluster side.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo_tui.api.server import ApiServer
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.inference.local import LocalPipeline, even_split
from exo_tui.inference.request import Request
from exo_tui.inference.sampling import SamplingParams
from tests.helpers.sshd import free_port
from tests.integration.cluster_helpers import cluster_config, node_processes

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "test-key-0123456789"


class Live:
    """A coordinator and its API servers, in an event loop on a thread of their own."""

    def __init__(self, peers: list[str], home: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = Coordinator(peers=peers, config=cluster_config(), home=home, strategy="even")
        self.open = ApiServer(self.coordinator, port=free_port())
        self.keyed = ApiServer(self.coordinator, port=free_port(), api_key=KEY)
        self.seen: list[Any] = []  # every event, tokens included (the bus's history keeps none)
        self._recorder: asyncio.Task[None] | None = None

    def call(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _record(self) -> None:
        with self.coordinator.events.subscribe(replay=True) as sub:
            while True:
                self.seen.append(await sub.get())

    async def start(self) -> None:
        self._recorder = asyncio.create_task(self._record())
        await self.coordinator.start()
        await self.open.start()
        await self.keyed.start()

    async def stop(self) -> None:
        await self.open.stop()
        await self.keyed.stop()
        await self.coordinator.stop()
        if self._recorder is not None:
            self._recorder.cancel()

    def events(self) -> list[Any]:
        return list(self.seen)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("api-home")
    with node_processes(home, ["onnx"]) as nodes:
        live = Live(nodes.peers, home)
        try:
            live.call(live.start())
            assert live.coordinator.plan is not None
            yield live
        finally:
            try:
                live.call(live.stop(), timeout=60)
            finally:
                live.loop.call_soon_threadsafe(live.loop.stop)
                live.thread.join(10)


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.open.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(live: Live):  # noqa: ANN201
    return live.coordinator.model.tokenizer


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m"]
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"


def test_chat_answers_correctly_with_exact_usage(client: openai.OpenAI, live: Live, tokenizer) -> None:  # noqa: ANN001
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(live.coordinator.model.chat_prompt_ids(QUESTION))
    # the answer's tokens, plus the end-of-turn token that stopped it
    assert r.usage.completion_tokens == len(tokenizer.encode(text, add_special=False)) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_gives_the_same_answer_and_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_stop_and_seed(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    short = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0,
                                           max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    cut = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=24,
                                         stop=[" Paris"])
    assert cut.choices[0].finish_reason == "stop" and "Paris" not in cut.choices[0].message.content
    assert cut.choices[0].message.content
    story = [{"role": "user", "content": "Write one sentence about a cat."}]
    a, b, c = (client.chat.completions.create(model="smollm2-135m", messages=story, temperature=0.9, seed=s,
                                              max_tokens=12).choices[0].message.content for s in (7, 7, 8))
    assert a == b, "the same seed gave different answers"
    greedy = {client.chat.completions.create(model="smollm2-135m", messages=story, temperature=0, seed=s,
                                             max_tokens=12).choices[0].message.content for s in (1, 2)}
    assert len(greedy) == 1
    assert c  # another seed still answers (it may or may not differ in 12 tokens)


def test_a_next_turn_reports_its_cached_prompt_tokens(client: openai.OpenAI) -> None:
    """The second turn of a conversation takes over the caches its first answer left; usage says
    how many of its prompt tokens were not run again (OpenAI's ``prompt_tokens_details``)."""
    first = [{"role": "user", "content": "Write a short story about a dragon."}]
    r1 = client.chat.completions.create(model="smollm2-135m", messages=first, temperature=0, max_tokens=40)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "Give the dragon a name."}]
    r2 = client.chat.completions.create(model="smollm2-135m", messages=second, temperature=0, max_tokens=8)
    assert r1.usage.prompt_tokens < r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


def test_sampling_left_out_is_the_models_recommendation(client: openai.OpenAI) -> None:
    """No temperature or top_p in the request: the default model's card's 0.2 and 0.9, not OpenAI's
    1 and 1 (with one seed the draws are the same as when they are given)."""
    story = [{"role": "user", "content": "Write one sentence about a cat."}]

    def answer(**sampling: float) -> str:
        return client.chat.completions.create(model="smollm2-135m", messages=story, seed=11, max_tokens=24,
                                              **sampling).choices[0].message.content

    left_out = answer()
    assert left_out == answer(temperature=0.2, top_p=0.9)
    assert left_out != answer(temperature=1.0, top_p=1.0)


def test_completions_endpoint(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    ids = client.completions.create(model="smollm2-135m", prompt=tokenizer.encode(prompt), max_tokens=4, temperature=0)
    assert ids.choices[0].text == r.choices[0].text


def _model_logprobs(live: Live, prompt_ids: list[int], top: int) -> Any:
    """The first answer token's logprobs from the default model run in this process (the reference)."""
    model = live.coordinator.model

    async def first() -> Any:
        pipeline = LocalPipeline()
        await pipeline.load(model.gguf, even_split(model.config.n_layers, ["onnx"]))
        try:
            return (await pipeline.step(Request(prompt_ids, SamplingParams(temperature=0), 1, top_logprobs=top), 0))[1]
        finally:
            await pipeline.close()

    return asyncio.run(first())


def test_chat_logprobs_are_the_models_own(client: openai.OpenAI, live: Live, tokenizer) -> None:  # noqa: ANN001
    asked = {"model": "smollm2-135m", "messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True,
             "top_logprobs": 2}
    r = client.chat.completions.create(**asked)
    content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == text
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # not the end of turn
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token  # greedy: the likeliest
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob
        assert math.exp(t.logprob) + math.exp(t.top_logprobs[1].logprob) <= 1 + 1e-6
    ref = _model_logprobs(live, live.coordinator.model.chat_prompt_ids(QUESTION), 2)
    assert tokenizer.token_bytes(ref.token) == bytes(content[0].bytes)
    assert content[0].logprob == pytest.approx(ref.logprob, abs=2e-3)
    assert [bytes(a.bytes) for a in content[0].top_logprobs] == [tokenizer.token_bytes(t) for t, _ in ref.top]
    streamed = [t for c in client.chat.completions.create(**asked, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    plain = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=12)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value <= 0 and len(top) <= 3 and max(top.values()) == value  # greedy
    streamed = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=0,
                                              logprobs=0, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_an_echoed_prompt_is_scored_token_by_token(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    """``echo`` with ``logprobs`` and ``max_tokens`` 0 scores a text (as evaluation harnesses do): each
    token's logprob given those before it, the same the model gave it when it generated it."""
    ids = tokenizer.encode("The capital of France is")
    made = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=2, temperature=0, logprobs=1)
    text = made.choices[0].text
    r = client.completions.create(model="smollm2-135m", prompt=ids + tokenizer.encode(text, add_special=False),
                                  max_tokens=0, echo=True, logprobs=1)
    lp, choice = r.choices[0].logprobs, r.choices[0]
    assert choice.text == tokenizer.decode(ids) + text and r.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.token_bytes(t).decode() for t in ids] + made.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # the answer's tokens scored as a prompt: what they were given when they were generated
    assert lp.token_logprobs[-2:] == pytest.approx(made.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(
        model="smollm2-135m", prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1, stream=True) if c.choices]
    assert streamed[0].text == tokenizer.decode(ids) and streamed[0].logprobs.tokens == lp.tokens[: len(ids)]
    assert streamed[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-4)
    assert "".join(c.text for c in streamed) == choice.text


def test_a_long_prompt_is_scored_in_pieces_as_its_beginning_alone(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    """A prompt four times the rows the last node scores at once: every token scored, and the
    first ones as they are when their prefix is all there is (the model reads left to right)."""
    ids = (tokenizer.encode("One two three four five six seven eight nine ten. ") * 100)[:1000]
    whole, head = (client.completions.create(model="smollm2-135m", prompt=p, max_tokens=0, echo=True, logprobs=5)
                   .choices[0].logprobs for p in (ids, ids[:100]))
    assert len(whole.token_logprobs) == 1000 and all(len(t) <= 6 for t in whole.top_logprobs[1:])
    assert whole.token_logprobs[1:100] == pytest.approx(head.token_logprobs[1:], abs=1e-3)
    assert sum(whole.token_logprobs[500:]) / 500 > sum(whole.token_logprobs[1:100]) / 99  # the pattern, learnt


def test_logprobs_asked_wrongly_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="smollm2-135m", prompt="Hi", echo=True, logprobs=6)


def test_errors_have_openai_shape_and_status(client: openai.OpenAI, live: Live) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    r = httpx.post(f"{live.open.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{live.open.url}/v1/chat/completions", json={"model": "smollm2-135m", "messages": []})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{live.open.url}/v1/nothing").json()["error"]["code"] == "404"


def test_api_key_is_enforced(live: Live) -> None:
    url = f"{live.keyed.url}/v1"
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0).models.list()
    r = httpx.get(f"{url}/cluster")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{url}/cluster/rebalance", json={"dry_run": True}).status_code == 401
    good = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["smollm2-135m"]
    assert httpx.get(f"{url}/cluster", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def _done(live: Live, rid: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [e for e in live.events() if e.kind == "request_done" and e.request_id == rid]
        if done:
            return done[-1]
        time.sleep(0.05)
    raise AssertionError(f"no request_done for {rid}")


def _node_requests(live: Live) -> set[str]:
    """Requests the node agents report holding (their heartbeats' per-request stats)."""
    return {rid for h in live.coordinator.nodes.values() for rid in h.metrics.get("requests", {})}


def _fresh_heartbeats(live: Live, count: int = 2, timeout: float = 60) -> None:
    """Wait until every node has sent ``count`` heartbeats from now on (each one replaces its
    handle's metrics): what they report then was measured after this call."""
    for _ in range(count):
        old = {node_id: h.metrics for node_id, h in live.coordinator.nodes.items()}
        deadline = time.monotonic() + timeout
        while any(live.coordinator.nodes[node_id].metrics is m for node_id, m in old.items()):
            assert time.monotonic() < deadline, "a node sent no heartbeat"
            time.sleep(0.05)


def _tokens_of(live: Live, rid: str) -> int:
    return sum(1 for e in live.events() if e.kind == "token" and e.request_id == rid)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_stops_its_generation(live: Live, stream: bool) -> None:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "temperature": 0.7, "seed": 3, "max_tokens": 2000, "stream": stream}
    before = {e.request_id for e in live.events() if e.kind == "request_done"}
    if stream:
        with httpx.stream("POST", f"{live.open.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = first.split('"id":"chatcmpl-', 1)[1].split('"', 1)[0]
            for _ in range(3):
                next(lines)
        # leaving the block closes the connection mid-answer
    else:
        with pytest.raises(httpx.ReadTimeout):  # well before the story can end (~150 tokens/s here)
            httpx.post(f"{live.open.url}/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 30
        rid = ""
        while not rid and time.monotonic() < deadline:
            rid = next((e.request_id for e in live.events() if e.kind == "request_done" and e.request_id not in before), "")
            time.sleep(0.05)
    done = _done(live, rid)
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens < 2000
    made = _tokens_of(live, rid)
    _fresh_heartbeats(live)  # what the nodes hold, reported after the cancel
    assert _tokens_of(live, rid) == made, "the cancelled request kept generating"
    assert rid not in live.coordinator.pipeline.in_flight()
    assert rid not in _node_requests(live), "a node still holds the cancelled request's cache"


COPY = [{"role": "user", "content": "Write a Python function named add that returns the sum of a and b."}]


def test_a_prediction_is_drafted_and_its_accepted_tokens_counted(client: openai.OpenAI) -> None:
    """OpenAI's Predicted Outputs through the official client: the answer is the one without
    speculation, the prediction's kept and drafted-but-rejected tokens are in the usage (streamed
    too, with include_usage), and on /v1/completions (extra_body)."""
    plain = client.chat.completions.create(model="smollm2-135m", messages=COPY, temperature=0, max_tokens=40,
                                           extra_body={"speculative": "off"})
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    same = client.chat.completions.create(model="smollm2-135m", messages=COPY, temperature=0, max_tokens=40,
                                          prediction={"type": "content", "content": text})
    assert same.choices[0].message.content == text
    details = same.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= same.usage.completion_tokens // 2
    counts = same.model_extra["speculation"]  # the extension: every source's drafts
    assert counts["accepted_tokens"] >= details.accepted_prediction_tokens and counts["verify_steps"] > 0
    assert plain.model_extra.get("speculation") is None  # nothing drafted
    # an edited prediction, with k fixed: auto may stop drafting it after its first rejections
    # (its measured acceptance and the plan's measured step costs decide), and then no draft is
    # rejected at all
    edited = text.replace("a", "e")
    stream = client.chat.completions.create(model="smollm2-135m", messages=COPY, temperature=0, max_tokens=40,
                                            prediction={"type": "content", "content": [{"type": "text", "text": edited}]},
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"speculative": 4})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage.completion_tokens_details
    assert usage.rejected_prediction_tokens > 0 and usage.accepted_prediction_tokens > 0
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    legacy = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=16,
                                       extra_body={"speculative": "off"})
    predicted = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=16,
                                          extra_body={"prediction": {"type": "content", "content": legacy.choices[0].text}})
    assert predicted.choices[0].text == legacy.choices[0].text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_speculation_asked_wrongly_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="speculative must be off, auto or a number of drafted tokens"):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=2,
                                       extra_body={"speculative": "fast"})
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=2,
                                       prediction={"type": "image", "content": "x"})  # type: ignore[typeddict-item]
