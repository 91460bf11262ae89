"""Bounded memory under load, on real node processes and the real HTTP API.

A node with a ``--memory-limit`` that holds the caches of about eight requests gets 64 at once:
none dies, the admitted ones answer as they do alone, a round's worth (the queue's bound) wait and
are served, the rest are refused with 429 and ``Retry-After``; the node's resident memory stays
under its limit above its runtime's baseline (what it measured at start, before the model). A
request preempted for memory (``admission.kv_share`` below 1) gives the tokens it gives undisturbed. Clients that go away mid-stream leave no cache on the node.

A node without a limit measures, once for the module, what a node of the tiny model holds for it
and how each prompt is answered alone (``Solo``); the limits and the answers of the tests come from it.

The model is a tiny random llama with many narrow layers, so that its KV caches are large next to
its weights and a step is cheap (the property is about memory, not the default model's answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from exo_tui.api.server import ApiServer
from exo_tui.cluster.coordinator import Coordinator
from tests.factory import write_tiny_llama
from tests.helpers.sshd import free_port
from tests.integration.cluster_helpers import cluster_config, node_processes

pytestmark = pytest.mark.slow

TINY = dict(n_layers=16, hidden=256, intermediate=512, n_heads=4, n_kv_heads=4, context_length=1024, seed=5)
PROMPTS = [f"question number {k}: tell me about {w}" for k, w in enumerate(("cats", "rivers", "stars", "bread"))]
MAX_TOKENS = 200
FIT = 8  # requests whose caches the node's limit holds
DEFAULT_MODEL_TOKENS = 256  # an answer of the default model: its caches ~7 MB, two or three of them the budget of a
# node that can just load the model (its load's peak a chunk's, ~16 MB: five answers of 96 tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-deep.gguf", **TINY)


@contextlib.asynccontextmanager
async def serving(peers: list[str], home: Path, model: Path, **admission: Any) -> AsyncIterator[tuple[Coordinator, str]]:
    config = cluster_config()
    for key, value in admission.items():
        setattr(config.admission, key, value)
    c = Coordinator(model=str(model), peers=peers, config=config, home=home, strategy="even", persist=False)
    server = ApiServer(c, port=free_port())
    await server.start()
    try:
        await c.start()
        yield c, server.url
    finally:
        await server.stop()
        await c.stop()


async def kv_report(c: Coordinator, *, fresh: bool = True, node_id: str | None = None) -> dict[str, Any]:
    """The node's (``node_id``'s, default the first's) KV report from a heartbeat sent after now (``fresh``)."""
    h = c.nodes[node_id] if node_id is not None else next(iter(c.nodes.values()))
    if fresh:
        seen = h.last_heartbeat_s
        for _ in range(100):
            await asyncio.sleep(0.1)
            if h.last_heartbeat_s != seen and "kv" in h.metrics:
                break
    return dict(h.metrics["kv"])


def chat_body(prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = False, model: str = "tiny-deep") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream}


async def answer(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = MAX_TOKENS,
                 model: str = "tiny-deep") -> httpx.Response:
    return await http.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens, model=model), timeout=600)


def measured_model(home: Path, model: Path, prompts: tuple[str, ...] = (), max_tokens: int = MAX_TOKENS,
                     model_id: str = "tiny-deep") -> tuple[int, int, int, dict[str, str]]:
    """Resident bytes a node holds for the model but no cache (above its runtime's baseline: what a
    limit must give it before any cache), the bytes a cache position takes,
    the positions a request of ``PROMPTS[0]`` and ``MAX_TOKENS`` holds, and each of ``prompts``
    answered alone (greedy, ``max_tokens``), on a node without a limit."""
    async def run(nodes: Any) -> tuple[int, int, int, dict[str, str]]:
        async with serving(nodes.peers, home, model) as (c, url), httpx.AsyncClient() as http:
            report = await kv_report(c)
            prompt = len(c.model.chat_prompt_ids([{"role": "user", "content": PROMPTS[0]}]))
            solo = {}
            for p in prompts:
                r = await answer(http, url, p, max_tokens, model_id)
                assert r.status_code == 200, r.text
                solo[p] = r.json()["choices"][0]["message"]["content"]
            # what it holds once it has run requests (ONNX Runtime's arenas grow with the first)
            settled = await kv_report(c) if prompts else report
            held = max(int(r["runtime_bytes"]) - int(r["runtime_baseline_bytes"]) for r in (report, settled))
            return held, int(report["bytes_per_position"]), prompt + MAX_TOKENS, solo

    with node_processes(home, ["onnx"], extra_args=["--no-benchmark"]) as nodes:
        return asyncio.run(run(nodes))


@dataclass(frozen=True)
class Solo:
    """What a node without a limit measured of the tiny model (see :func:`measured_model`)."""

    held: int  # for the model, above the runtime's baseline
    per_position: int
    positions: int
    answers: dict[str, str]  # each of PROMPTS answered alone


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Solo:
    return Solo(*measured_model(tmp_path_factory.mktemp("solo"), tiny, tuple(PROMPTS)))


def limit_for(held: int, per_position: int, positions: int, requests: int) -> float:
    """A --memory-limit (GB) whose KV budget holds ``requests`` requests of ``positions`` (the
    inverse of :class:`~exo_tui.node.kv_budget.KVBudget`'s budget) beside ``held``."""
    from exo_tui.node.kv_budget import RESERVE_FRACTION, RESERVE_MIN_BYTES

    room = requests * positions * per_position
    return (held + max(room / (1 - RESERVE_FRACTION), room + RESERVE_MIN_BYTES)) / 1e9


class RssWatch:
    """The highest resident memory of a process, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            await asyncio.sleep(0.05)

    def __enter__(self) -> RssWatch:
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def test_64_requests_on_a_node_that_holds_8(tmp_path: Path, tiny: Path, solo: Solo) -> None:
    held, per_position, positions = solo.held, solo.per_position, solo.positions
    limit_gb = limit_for(held, per_position, positions, FIT)
    bound = FIT  # a round of waiting requests, served after the first round; the rest refused

    async def run(nodes: Any) -> None:
        node = nodes.nodes[0]
        async with serving(nodes.peers, tmp_path, tiny, queue_bound=bound) as (c, url), httpx.AsyncClient() as http:
            report = await kv_report(c)
            assert report["limit_bytes"] == int(limit_gb * 1e9) and report["runtime_baseline_bytes"] > 0
            ceiling = report["runtime_baseline_bytes"] + limit_gb * 1e9
            cap = c.admission.stats().capacity_positions
            assert cap is not None and FIT - 1 <= cap // positions <= FIT + 1, (cap, positions, report)
            with RssWatch(node.process.pid) as rss:
                results = await asyncio.gather(*(answer(http, url, PROMPTS[i % len(PROMPTS)]) for i in range(64)))
            assert node.process.poll() is None, "the node died"
            ok = [(i, r) for i, r in enumerate(results) if r.status_code == 200]
            refused = [r for r in results if r.status_code == 429]
            assert len(ok) + len(refused) == 64, [r.status_code for r in results]
            for i, r in ok:
                assert r.json()["choices"][0]["message"]["content"] == solo.answers[PROMPTS[i % len(PROMPTS)]], i
            # at most FIT ran at once, a bound's worth waited and were then served; the rest were refused
            assert len(ok) >= FIT + bound - 2 and len(refused) >= 64 - FIT - bound - 2
            for r in refused:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["code"] == "rate_limit_exceeded" and "busy" in err["message"]
            stats = c.admission.stats()
            # a request preempted for memory is admitted once more when it resumes
            assert stats.rejected == len(refused) and stats.admitted == len(ok) + stats.preempted, stats
            print(f"\n64 requests, limit {limit_gb * 1000:.0f} MB (model {held / 1e6:.0f} MB, runtime "
                  f"{report['runtime_baseline_bytes'] / 1e6:.0f} MB, a request "
                  f"{positions * per_position / 1e6:.1f} MB of KV): {len(ok)} served, {len(refused)} refused; "
                  f"peak RSS {rss.peak / 1e6:.0f} MB")
            assert rss.peak < ceiling, (rss.peak, ceiling)
            after = await kv_report(c)
            assert after["refused"] == 0  # admission kept every step within the node's budget
            assert after["used_bytes"] <= after["budget_bytes"]

    with node_processes(tmp_path, ["onnx"], memory_limits_gb=[limit_gb], extra_args=["--no-benchmark"]) as nodes:
        asyncio.run(run(nodes))


def test_a_preempted_request_gives_its_undisturbed_tokens(tmp_path: Path, tiny: Path, solo: Solo) -> None:
    # 4 whole requests (what the scheduler needs to place the model fits too); 8 half ones admitted
    limit_gb = limit_for(solo.held, solo.per_position, solo.positions, 4)

    async def run(nodes: Any) -> None:
        async with serving(nodes.peers, tmp_path, tiny, kv_share=0.5) as (c, url), httpx.AsyncClient() as http:
            await kv_report(c)
            results = await asyncio.gather(*(answer(http, url, p) for p in PROMPTS * 2))
            assert [r.json()["choices"][0]["message"]["content"] for r in results] == \
                [solo.answers[p] for p in PROMPTS * 2]
            assert c.admission.stats().preempted >= 1
            assert (await kv_report(c))["refused"] == 0

    with node_processes(tmp_path, ["onnx"], memory_limits_gb=[limit_gb], extra_args=["--no-benchmark"]) as nodes:
        asyncio.run(run(nodes))


def test_clients_that_go_away_mid_stream_leave_no_cache(tmp_path: Path, tiny: Path) -> None:
    async def run(nodes: Any) -> None:
        async with serving(nodes.peers, tmp_path, tiny) as (c, url), httpx.AsyncClient() as http:
            async def leave_after(n: int, prompt: str) -> int:
                seen = 0
                async with http.stream("POST", f"{url}/v1/chat/completions",
                                       json=chat_body(prompt, 900, stream=True), timeout=120) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            seen += 1
                            if seen >= n:
                                break  # closes the connection mid-stream
                return seen

            assert await asyncio.gather(*(leave_after(5 + i, p) for i, p in enumerate(PROMPTS))) == \
                [5 + i for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                report = await kv_report(c)
                if report["requests"] == 0 and not c._active:
                    break
            assert report["requests"] == 0 and report["used_bytes"] == 0, report
            assert c.admission.stats().running == 0

    with node_processes(tmp_path, ["onnx"], extra_args=["--no-benchmark"]) as nodes:
        asyncio.run(run(nodes))


def test_the_default_model_on_a_node_that_holds_two_answers(tmp_path: Path) -> None:
    """The same on the real default model, smaller: six answers at once on a node whose limit
    holds two or three (the room its load needs beside the model leaves its caches a little more
    than two); every one is its solo answer, the node stays under its limit above its baseline."""
    from exo_tui.models.catalog import resolve_model
    from exo_tui.models.gguf_file import GGUFModel
    from exo_tui.models.model import Model
    from exo_tui.node.kv_budget import RESERVE_MIN_BYTES

    model = resolve_model(None)
    mid = model.stem
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 2 + 2?"]
    held, per_position, _, solo = measured_model(tmp_path, model, tuple(questions), DEFAULT_MODEL_TOKENS, mid)
    m = Model(model)
    positions = max(len(m.chat_prompt_ids([{"role": "user", "content": q}])) for q in questions) + DEFAULT_MODEL_TOKENS
    # The node admits the load with its peak and its least reserve beside what it holds; what it
    # holds once loaded (``held``, measured) bounds what it held before plus the shard's arrays.
    # The 2 MB: what the runtime's resident memory varies by between two starts.
    gguf = GGUFModel(model)
    loadable = held + gguf.load_peak_nbytes(0, gguf.config.n_layers, "onnx") + RESERVE_MIN_BYTES + (2 << 20)
    limit_gb = max(limit_for(held, per_position, positions, 2), loadable / 1e9)

    async def run(nodes: Any) -> None:
        node = nodes.nodes[0]
        async with serving(nodes.peers, tmp_path, model) as (c, url), httpx.AsyncClient() as http:
            report = await kv_report(c)
            baseline = report["runtime_baseline_bytes"]
            assert report["budget_bytes"] < 6 * positions * per_position, report  # the six do not fit at once
            with RssWatch(node.process.pid) as rss:
                results = await asyncio.gather(*(answer(http, url, questions[i % 3], DEFAULT_MODEL_TOKENS, mid) for i in range(6)))
            assert [r.status_code for r in results] == [200] * 6, [r.text for r in results if r.status_code != 200]
            assert [r.json()["choices"][0]["message"]["content"] for r in results] == [solo[questions[i % 3]] for i in range(6)]
            assert "Paris" in solo[questions[0]]
            assert rss.peak < baseline + limit_gb * 1e9, (rss.peak, baseline, limit_gb)
            assert (await kv_report(c))["refused"] == 0

    with node_processes(tmp_path, ["onnx"], memory_limits_gb=[limit_gb], extra_args=["--no-benchmark"]) as nodes:
        asyncio.run(run(nodes))
