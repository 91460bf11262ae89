"""Ollama's API of ``exo-tui serve``, driven by the official ``ollama`` Python package.

One ``exo-tui serve --model smollm2:135m`` process (one local ONNX node agent) runs with HOME at a
test store (tests/model_store.py): the name resolves to the Ollama blob of the default model, and
the store's other models are listed. Greedy answers are compared with the OpenAI endpoint's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from exo_tui.cluster.view import Command
from exo_tui.commands.serve import READY_PREFIX
from tests.helpers.benchmarks import share_benchmarks
from tests.helpers.sshd import free_port
from tests.model_store import Store, build_store

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0, "num_predict": 24}


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str, store: Store) -> None:
        self.proc, self.url, self.store = proc, url, store


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Iterator[Served]:
    d = tmp_path_factory.mktemp("ollama-serve")
    store = build_store(d, default_model_path)
    exo_home = d / "exo"
    exo_home.mkdir(mode=0o700)
    share_benchmarks(exo_home)  # the local node's start-up benchmark, once a session
    config = d / "config.yaml"
    config.write_text("scheduler:\n  fault_tolerance:\n    heartbeat_timeout: 10\n"
                      f"models:\n  paths: [{json.dumps(str(store.folder))}]\n")
    env = {**store.env, "EXO_TUI_HOME": str(exo_home), "EXO_TUI_CONFIG": str(config)}
    env.pop("EXO_TUI_API_KEY", None)
    port = free_port()
    err = open(d / "serve.err", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "exo_tui.cli", "serve", "--model", MODEL, "--local-nodes", "1", "--backends", "onnx",
         "--api-port", str(port)],
        stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), f"serve did not start: {line!r}\n{(d / 'serve.err').read_text()[-3000:]}"
        yield Served(proc, f"http://127.0.0.1:{port}", store)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        err.close()


@pytest.fixture(scope="module")
def client(served: Served) -> ollama.Client:
    return ollama.Client(host=served.url, timeout=300)


def test_list_names_the_store_s_usable_models_served_first(client: ollama.Client) -> None:
    models = client.list().models
    names = [m.model for m in models]
    assert names[0] == MODEL
    assert {"smollm2:latest", "someone/tiny:q8", "SmolLM2-135M-Instruct-Q4_1-lms:latest",
            "smollm2-135m-instruct-q4_1-hf:latest"} <= set(names)
    assert not {n for n in names if n.startswith(("broken", "gone", "truncated", "odd-family", "tiny-split"))}
    first = models[0]
    assert first.details.family == "llama" and first.details.quantization_level == "Q4_1"
    assert first.details.parameter_size == "135M" and first.details.format == "gguf"
    assert first.size == 98_362_432 and len(first.digest) == 64


def test_show_gives_the_header_s_facts(client: ollama.Client) -> None:
    r = client.show(MODEL)
    assert r.details.family == "llama" and r.details.quantization_level == "Q4_1"
    assert r.modelinfo["general.architecture"] == "llama" and r.modelinfo["llama.context_length"] == 8192
    assert 130e6 < r.modelinfo["general.parameter_count"] < 140e6
    assert "im_start" in r.template and "temperature 0.2" in r.parameters
    tiny = client.show("someone/tiny:q8")  # shown though not loaded
    assert tiny.details.quantization_level == "Q8_0"
    with pytest.raises(ollama.ResponseError) as info:
        client.show("broken")
    assert info.value.status_code == 404 and "manifest" in info.value.error


def test_chat_streamed_and_not_equals_the_openai_endpoint_greedy(client: ollama.Client, served: Served) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat(MODEL, messages=messages, stream=False, options=GREEDY)
    assert whole.done and whole.message.role == "assistant" and "Paris" in whole.message.content
    parts = list(client.chat(MODEL, messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == whole.done_reason
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert whole.prompt_eval_count > 0 and whole.eval_count > 0 and whole.total_duration > 0
    oa = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
    r = oa.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == whole.message.content
    assert r.usage.completion_tokens == whole.eval_count and r.usage.prompt_tokens == whole.prompt_eval_count


def test_generate_answers_as_chat_does(client: ollama.Client) -> None:
    chat = client.chat(MODEL, messages=[{"role": "user", "content": QUESTION}], stream=False, options=GREEDY)
    r = client.generate(MODEL, QUESTION, options=GREEDY)
    assert r.done and r.response == chat.message.content
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count
    streamed = list(client.generate(MODEL, QUESTION, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == r.response and streamed[-1].done


def test_options_map_to_sampling(client: ollama.Client) -> None:
    short = client.generate(MODEL, QUESTION, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    full = client.generate(MODEL, QUESTION, options=GREEDY).response
    word = full.split()[2]
    stopped = client.generate(MODEL, QUESTION, options={**GREEDY, "stop": [word]}).response
    assert stopped == full[: full.index(word)]
    seeded = [client.generate(MODEL, QUESTION, options={"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11,
                                                        "repeat_penalty": 1.1, "num_predict": 8}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_what_it_cannot_do_is_refused_in_ollama_s_shape(client: ollama.Client, served: Served) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(MODEL, messages=[{"role": "user", "content": "hi"}], format="json", stream=False)
    assert info.value.status_code == 400 and "format" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat("someone/tiny:q8", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert info.value.status_code == 404 and "not loaded" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.generate("nothing:7b", "hi")
    assert info.value.status_code == 404 and "not found" in info.value.error
    bad = httpx.post(f"{served.url}/api/chat", content=b"{nope", timeout=30)
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)
    bad = httpx.post(f"{served.url}/api/generate", json={"model": MODEL, "prompt": "x", "options": {"num_predict": "many"}},
                     timeout=30)
    assert bad.status_code == 400 and "num_predict" in bad.json()["error"]


def test_ps_version_and_an_empty_prompt(client: ollama.Client, served: Served) -> None:
    running = client.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length == 8192
    assert httpx.get(f"{served.url}/api/version", timeout=30).json()["version"]
    loaded = client.generate(MODEL, "")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    # a request that leaves stream out is streamed, as NDJSON
    r = httpx.post(f"{served.url}/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                   "options": GREEDY}, timeout=300)
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert r.headers["content-type"].startswith("application/x-ndjson") and len(lines) > 2
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]


def test_v1_models_lists_the_catalog_too(served: Served) -> None:
    oa = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
    ids = [m.id for m in oa.models.list().data]
    assert ids[0] == MODEL and "someone/tiny:q8" in ids and "broken:latest" not in ids


def test_the_cluster_s_model_choices_and_a_switch_preview(served: Served) -> None:
    import asyncio

    from exo_tui.api.client import ClusterClient

    async def ask() -> tuple[list, object, object]:
        async with ClusterClient(served.url) as control:
            return (await control.models(), await control.preview(Command("model", model="someone/tiny:q8")),
                    await control.preview(Command("model", model="gone:7b")))

    choices, preview, broken = asyncio.run(ask())
    by_name = {c.name: c for c in choices}
    assert by_name[MODEL].current and by_name[MODEL].fits and by_name[MODEL].tok_per_s > 0
    assert by_name["someone/tiny:q8"].fits and not by_name["someone/tiny:q8"].current
    assert not by_name["truncated"].usable and by_name["truncated"].fits is None and "truncated" in by_name["truncated"].reason
    assert preview.action == "model" and not preview.error and preview.moves and all(m.src is None for m in preview.moves)
    assert preview.tok_per_s_before > 0 and preview.tok_per_s_after > 0
    assert "is missing" in broken.error
