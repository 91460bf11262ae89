"""Pipeline inference across node agent processes on loopback (issue: node agent, wire, pipeline).

The real default model's greedy answer must be token-for-token the single-process answer, for
rings of 2, 3 and 4 nodes with MLX and ONNX mixed. Node processes are started once for the module
and every test's coordinator attaches to a subset of them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest

from backends.base import PREFILL_CHUNK
from exo_tui.cluster.local_nodes import spawn_node, stop_node, wait_ready
from exo_tui.cluster.view import ChatParams
from exo_tui.cluster.weights import WeightTransferError, stream_shard
from exo_tui.events import RequestDone
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.net.client import connect
from exo_tui.net.errors import AuthError, HandshakeError, RemoteError
from exo_tui.net.security import Security, ensure_cluster
from tests.integration.cluster_helpers import coordinator, node_processes, reference_answer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = ChatParams(temperature=0.0, max_tokens=24, seed=1)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("exo-home")
    os.environ["EXO_TUI_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def nodes(home: Path):
    with node_processes(home, ["mlx", "onnx", "mlx", "onnx"]) as ns:
        yield ns


@pytest.fixture(scope="module")
def reference_tokens(default_model_path: Path) -> list[int]:
    """The single-process greedy answer (ONNX, whole model in one shard), without end tokens."""
    tokens = reference_answer(default_model_path, QUESTION[0]["content"], GREEDY.max_tokens, seed=1)
    assert tokens, "the reference run produced no tokens"
    return tokens


async def _answer(c) -> tuple[list[int], str, tuple[str, ...]]:  # noqa: ANN001
    ids: list[int] = []
    text = []
    last = None
    async for chunk in c.chat(QUESTION, GREEDY):
        ids.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.finish_reason in ("stop", "length"), last
    return ids, "".join(text), last.nodes


@pytest.mark.parametrize("count", [3, 2, 4])
def test_ring_matches_single_process(nodes, reference_tokens: list[int], count: int) -> None:
    peers = nodes.peers[:count] if count != 3 else [nodes.peers[0], nodes.peers[1], nodes.peers[2]]

    async def run() -> None:
        async with coordinator(nodes, peers=peers) as c:
            assert c.plan is not None and len(c.plan.shards) == count
            backends = [c.nodes[s.node_id].profile.backends[0] for s in c.plan.shards]
            ids, text, served = await _answer(c)
            assert ids == reference_tokens, f"{count} nodes ({backends}) answered {text!r}"
            assert "Paris" in text
            assert len(served) == count
            # the last node handed its tokens straight to the first (the coordinator told in parallel)
            assert c.pipeline.handed_steps > 0
            # ... and the coordinator still ends the answer exactly: at a stop string (the ring may
            # have drawn past it), and at max_tokens (the ring never draws past it)
            chunks = [x async for x in c.chat(QUESTION, replace(GREEDY, stop=("Paris",)))]
            assert chunks[-1].finish_reason == "stop"
            assert "".join(x.text for x in chunks) == text[: text.index("Paris")]
            chunks = [x async for x in c.chat(QUESTION, replace(GREEDY, max_tokens=7))]
            assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 7
            assert [t for x in chunks for t in x.token_ids] == reference_tokens[:7]

    asyncio.run(run())


def test_a_penalty_over_the_history_sees_the_prompt_too(nodes, default_model_path: Path) -> None:
    """A repetition penalty counts the prompt's tokens as well as the answer's: the ring's last
    node is sent the whole history, and the answer is the single process's."""
    params = ChatParams(temperature=0.0, max_tokens=12, seed=1, repetition_penalty=1.5, stop=())
    want = reference_answer(default_model_path, QUESTION[0]["content"], params.max_tokens, seed=1,
                            repetition_penalty=params.repetition_penalty)

    async def run() -> list[int]:
        async with coordinator(nodes, peers=nodes.peers[:2]) as c:
            return [t for chunk in [x async for x in c.chat(QUESTION, params)] for t in chunk.token_ids]

    assert [t for t in asyncio.run(run()) if t not in (0, 2)] == want  # SmolLM2's end tokens


LONG = ("The keeper climbed the stairs at dusk and lit the great lamp, and the ships far out at sea "
        "saw its light sweep over the waves. ") * 40 + "What did the keeper do?"


@pytest.mark.parametrize("params", [ChatParams(temperature=0.0, max_tokens=12, seed=1),
                                    ChatParams(temperature=0.9, max_tokens=12, seed=5)], ids=["greedy", "sampled"])
def test_a_long_prompt_goes_through_the_ring_in_chunks_and_answers_as_one_process(
        nodes, default_model_path: Path, params: ChatParams) -> None:
    """A prompt longer than a step's rows (PREFILL_CHUNK: 512) goes through the ring a chunk at a
    time, the last hop drawing nothing until the last chunk: the answer is one process's, token
    for token, greedy and sampled. These nodes share this machine's cores, each running on all of
    them: a chunk at a time through the ring (run at once, they would take the cores from each
    other)."""
    want = reference_answer(default_model_path, LONG, params.max_tokens, seed=params.seed,
                            temperature=params.temperature)

    async def run() -> None:
        async with coordinator(nodes, peers=[nodes.peers[1], nodes.peers[3]]) as c:  # the ONNX nodes
            assert await _long_answer(c, params) == want
            assert c.pipeline.filled_chunks >= 2 and c.pipeline.most_chunks_in_flight == 1

    asyncio.run(run())


def test_a_long_prompts_chunks_are_pipelined_through_nodes_that_run_beside_each_other(
        tmp_path: Path, default_model_path: Path) -> None:
    """Nodes whose threads together fit the machine's cores (one each here) run a prompt's chunks
    at once: the next chunk goes out before the one before comes back, one a node, each node runs
    them in order, and the answer is one process's, token for token."""
    if (psutil.cpu_count(logical=False) or 1) < 2:
        pytest.skip("one core: two nodes of this machine cannot run at once, so chunks go one at a time")
    params = ChatParams(temperature=0.0, max_tokens=12, seed=1)
    want = reference_answer(default_model_path, LONG, params.max_tokens, seed=params.seed)
    with node_processes(tmp_path, ["onnx", "onnx"], extra_args=["--threads", "1"]) as ns:
        async def run() -> None:
            async with coordinator(ns) as c:
                assert len(c.plan.shards) == 2, c.plan.layout
                assert await _long_answer(c, params) == want
                assert c.pipeline.filled_chunks >= 2 and c.pipeline.most_chunks_in_flight == 2
                assert c.pipeline.steps_in_flight() == 0  # every chunk came back and none is waited for

        asyncio.run(run())


async def _long_answer(c, params: ChatParams) -> list[int]:  # noqa: ANN001
    assert len(c.model.chat_prompt_ids([{"role": "user", "content": LONG}])) > 2 * PREFILL_CHUNK
    ids: list[int] = []
    async for chunk in c.chat([{"role": "user", "content": LONG}], params):
        assert not chunk.error, chunk.error
        ids.extend(chunk.token_ids)
    return [t for t in ids if t not in c.model.tokenizer.eos_ids]


def test_weights_streamed_to_nodes(nodes, reference_tokens: list[int]) -> None:
    """Nodes load nothing from disk: every shard is streamed by the coordinator."""

    async def run() -> None:
        async with coordinator(nodes, peers=nodes.peers[2:], weights="stream") as c:  # nodes no earlier test here served two-way: they hold no shard to adopt
            ids, text, _ = await _answer(c)
            assert ids == reference_tokens
            progress = [e for e in c.events.history if e.kind == "shard_progress"]
            assert progress and all(e.done_bytes <= e.total_bytes for e in progress)
            assert any(e.done_bytes == e.total_bytes for e in progress)

    asyncio.run(run())


def test_a_stop_that_lands_with_a_token_stops_the_answer(nodes) -> None:
    """Stopping an answer cancels the task consuming it. When the cancel lands in the same turn of
    the event loop as a token's frame (the token's step is then done, its task not yet resumed),
    the answer stops there: it did not with ``asyncio.wait_for`` on Python 3.11, which returned
    the token and dropped the cancel, so the answer ran on to ``max_tokens``."""
    params = ChatParams(temperature=0.0, max_tokens=64, seed=1, stop=())

    async def run() -> None:
        async with coordinator(nodes, peers=nodes.peers[:2]) as c:
            seen: list[int] = []

            async def consume() -> None:
                async for _ in c.chat([{"role": "user", "content": "Count from one to one hundred."}], params):
                    pass

            task = asyncio.create_task(consume())
            on_token = c.pipeline.on_token

            def token_then_stop(*args) -> None:  # noqa: ANN002
                on_token(*args)  # resolves the step's future...
                seen.append(args[3])
                if len(seen) == 4:
                    task.cancel()  # ...and the operator's stop lands before the task runs again

            c.pipeline.on_token = token_then_stop
            with pytest.raises(asyncio.CancelledError):
                await task
            # the answer ended there (the ring, handing its tokens on by itself, may have drawn
            # another before the drop reached it: no answer has it)
            done = [e for e in c.events.history if isinstance(e, RequestDone)][-1]
            assert done.finish_reason == "cancelled" and done.completion_tokens <= 4, \
                f"the answer went on for {done.completion_tokens} tokens after the stop"
            assert c.pipeline.handed_steps > 0  # the stop landed while the ring ran on its own
            assert not c.pipeline.in_flight() and not c.pipeline.steps_in_flight()
            del c.pipeline.on_token
            ids, text, _ = await _answer(c)  # and the cluster serves the next request
            assert "Paris" in text

    asyncio.run(run())


def test_a_token_frame_that_cannot_be_read_fails_its_step_at_once_and_the_answer_goes_on(
        nodes, reference_tokens: list[int]) -> None:
    """A node's token frame whose body does not fit (here its token is a string) is refused with
    an error frame to the node, and the step it names fails at once and is run again: the answer
    is still the single-process one. Before, the step waited out its 600 s timeout."""

    async def run() -> None:
        async with coordinator(nodes, peers=nodes.peers[:2]) as c:
            bent: list[str] = []
            for handle in c.nodes.values():
                conn = handle.live_conn
                assert conn is not None and conn.handler is not None
                forward = conn.handler

                async def bend(conn, frame, forward=forward):  # noqa: ANN001, ANN202
                    if frame.type == "token" and not bent:
                        bent.append(frame.body["rid"])
                        frame = replace(frame, body={**frame.body, "token": "seven"})
                    return await forward(conn, frame)

                conn.handler = bend
            ids, _, _ = await asyncio.wait_for(_answer(c), 120)  # only a hung step fails this
            assert bent, "no token frame was bent"
            assert ids == reference_tokens
            assert c.pipeline.failed_steps >= 1

    asyncio.run(run())


def test_corrupted_chunk_is_detected_and_resent(nodes, tiny_model: Path, home: Path) -> None:
    security = ensure_cluster(home).security()
    model = GGUFModel(tiny_model)

    async def run() -> None:
        conn = await connect("127.0.0.1", nodes.nodes[1].port, security=security)
        try:
            await conn.call("attach")
            corrupted: list[int] = []

            def once(index: int, data: bytes) -> bytes:
                if index == 0 and not corrupted:
                    corrupted.append(index)
                    return bytes([data[0] ^ 0xFF]) + data[1:]
                return data

            body = await stream_shard(conn, model, 0, model.config.n_layers, "onnx", corrupt=once)
            assert corrupted == [0] and (body.start, body.end) == (0, model.config.n_layers)

            with pytest.raises(WeightTransferError, match="checksum"):
                await stream_shard(conn, model, 0, 2, "onnx", corrupt=lambda i, d: d[:-1] + bytes([d[-1] ^ 1]))
        finally:
            await conn.aclose()

    asyncio.run(run())


def test_node_refuses_wrong_cluster_and_keeps_serving(nodes, tmp_path: Path, home: Path) -> None:
    other = ensure_cluster(tmp_path / "other-cluster").security()
    ours = ensure_cluster(home).security()

    async def run() -> None:
        with pytest.raises(HandshakeError):  # TLS refuses a certificate from another cluster's CA
            await connect("127.0.0.1", nodes.nodes[0].port, security=other, timeout=5)
        no_tls_no_key = Security(cluster_key=os.urandom(32), enable_tls=False)
        with pytest.raises((AuthError, ConnectionError)):
            await connect("127.0.0.1", nodes.nodes[0].port, security=no_tls_no_key, timeout=5)
        conn = await connect("127.0.0.1", nodes.nodes[0].port, security=ours)
        try:
            reply = await conn.call("ping", {"t": 1})
            assert reply.type == "pong"
            # Only the defined operations exist; anything else is refused, the node goes on.
            with pytest.raises(RemoteError, match="unknown operation"):
                await conn.call("exec", {"cmd": "rm -rf /"})
            with pytest.raises(RemoteError):
                await conn.call("kv_import", {"rid": "x", "start": 0, "end": 2}, tensor=np.zeros((3, 3), np.float32))
            assert (await conn.call("ping", {"t": 2})).type == "pong"
        finally:
            await conn.aclose()

    asyncio.run(run())


def test_node_refuses_steps_for_unknown_plan(nodes, home: Path) -> None:
    security = ensure_cluster(home).security()

    async def run() -> None:
        conn = await connect("127.0.0.1", nodes.nodes[2].port, security=security)
        try:
            await conn.call("attach")
            with pytest.raises(RemoteError, match="does not hold plan 987654"):
                await conn.call("forward", {"rid": "r", "hop": 0, "pos": 0, "step": 0, "n_tokens": 1}, tensor=np.array([1]), plan=987654)
        finally:
            await conn.aclose()

    asyncio.run(run())


def test_sigterm_stops_node_cleanly(home: Path) -> None:
    """A spawned node binds a free port itself, says which, serves on it, and stops on SIGTERM."""
    bundle = home / "nodes" / "sigterm.bundle"
    from exo_tui.net.security import write_node_bundle

    write_node_bundle(bundle, ensure_cluster(home).node_bundle("sigterm"))
    node = spawn_node("sigterm", backend="onnx", key_file=str(bundle), log_dir=home / "logs",
                      env={"EXO_TUI_HOME": str(home)}, extra_args=["--no-benchmark"])
    try:
        assert node.port == 0  # no port picked here (another socket could take it before the node binds)
        asyncio.run(wait_ready(node))
        assert node.port > 0  # the one the node bound, from its ready line

        async def ping() -> str:
            async with await connect("127.0.0.1", node.port, security=ensure_cluster(home).security()) as conn:
                return (await conn.call("ping", {"t": 1})).type

        assert asyncio.run(ping()) == "pong"
        os.killpg(node.pid, signal.SIGTERM)
        assert node.process.wait(15) == 0
    finally:
        stop_node(node)


def test_chat_cli_local_nodes(default_model_path: Path, home: Path, reference_tokens: list[int]) -> None:
    """``exo-tui chat --local-nodes 3 --backends mlx,onnx,mlx`` as a user runs it."""
    env = {**os.environ, "EXO_TUI_HOME": str(home)}
    out = subprocess.run(
        [sys.executable, "-m", "exo_tui.cli", "chat", "--local-nodes", "3", "--backends", "mlx,onnx,mlx",
         "--temperature", "0", "--seed", "1", "--max-tokens", str(GREEDY.max_tokens), "--json", "What is the capital of France?"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [t for t in result["completion_token_ids"] if t not in (0, 2)] == reference_tokens  # SmolLM2's end tokens
    assert "Paris" in result["text"]
    assert len(result["served_by"]) == 3
    # Every node process it started is gone (or on its way out: waited for, 30 s at most).
    nodes = [p for p in psutil.process_iter(["pid", "cmdline"])
             if any(str(home / "nodes") in part and "-local" in part for part in (p.info["cmdline"] or []))]
    _, left = psutil.wait_procs(nodes, timeout=30)
    assert not left, f"node processes left behind: {[p.pid for p in left]}"


OPS = ["attach", "profile", "load", "load_begin", "load_chunk", "load_commit", "unload", "plan", "forward",
       "kv_export", "kv_import", "drop", "ping", "link_probe", "exec", "__init__", "eval"]


def test_fuzz_operations_at_a_live_node(nodes, home: Path) -> None:
    """Well-formed frames with generated operations, bodies and tensors: every one is answered
    (a reply or an error), the node never executes anything else, and it keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp

    security = ensure_cluster(home).security()
    target = nodes.nodes[3]
    values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=6,
    )
    keys = st.sampled_from(["rid", "start", "end", "hop", "pos", "step", "n_tokens", "path", "plan", "transfer_id",
                            "offset", "sha256", "tensors", "config", "host", "port", "sampling", "history"])
    bodies = st.dictionaries(keys, values, max_size=6)
    tensors = st.none() | hnp.arrays(st.sampled_from([np.float32, np.int64, np.uint8]), hnp.array_shapes(max_dims=3, max_side=5))

    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(connect("127.0.0.1", target.port, security=security))
    try:
        @settings(max_examples=120, suppress_health_check=list(HealthCheck))
        @given(op=st.sampled_from(OPS), body=bodies, tensor=tensors, plan=st.none() | st.integers(0, 3))
        def throw(op: str, body: dict, tensor, plan) -> None:  # noqa: ANN001
            if op == "link_probe":
                body = {**body, "host": "127.0.0.1", "port": 1}  # loopback only, a closed port
            if op == "load":
                body = {**body, "path": "/nonexistent/model.gguf"}

            async def one() -> None:
                try:
                    await conn.call(op, body, tensor=tensor, plan=plan, timeout=20)
                except RemoteError:
                    pass
                pong = await conn.call("ping", {"t": 0}, timeout=20)
                assert pong.type == "pong"

            loop.run_until_complete(one())

        throw()
        assert target.alive()
    finally:
        loop.run_until_complete(conn.aclose())
        loop.close()


async def _turn(c, messages: list[dict[str, str]], params: ChatParams):  # noqa: ANN001, ANN202
    request = c.new_request(messages, params)
    ids, text = [], ""
    async for chunk in c.generate(request):
        if chunk.token_id is not None:
            ids.append(chunk.token_id)
        text += chunk.text
    return request, ids, text


async def _cached_on(node, rid: str, shard) -> int:  # noqa: ANN001
    """How many positions of ``rid`` a node holds for ``shard``'s layers (0: none)."""
    conn = await connect("127.0.0.1", node.port, security=ensure_cluster().security(), timeout=5)
    try:
        reply = await conn.call("kv_export", {"rid": rid, "start": shard.start, "end": shard.end}, timeout=10)
        return int(reply.body["length"])
    finally:
        await conn.aclose()


def test_next_turn_takes_over_the_conversations_caches(nodes) -> None:
    """(Last in the module: its two-node ring leaves shards loaded that the streaming test must
    find missing.) A chat's next turn sends the whole conversation again. Its first step takes over the caches
    the previous answer left on the ring (MLX and ONNX) and runs only what follows, and the answer
    is the one a coordinator without those caches gives. Asking the same question again takes
    nothing over; only the last two finished requests are kept, and a stopping coordinator drops
    them."""
    params = ChatParams(temperature=0.0, max_tokens=16, seed=1)  # the answers compared are 16 tokens
    first = [{"role": "user", "content": "Write a short story about a dragon."}]

    async def run() -> None:
        async with coordinator(nodes, peers=nodes.peers[:2]) as c:
            r1, _, a1 = await _turn(c, first, params)
            second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "Give the dragon a name."}]
            r2, ids2, _ = await _turn(c, second, params)
            assert len(r1.prompt_ids) < r2.cached_tokens < len(r2.prompt_ids), (len(r1.prompt_ids), r2.cached_tokens)
            again, _, _ = await _turn(c, first, params)
            assert again.cached_tokens == 0  # the same question is run again from its first token
            shards = list(c.plan.shards)
            holders = [(n, s) for s in shards for n in nodes.nodes if f"127.0.0.1:{n.port}" == c.nodes[s.node_id].address]
            assert len(holders) == 2
            assert all([await _cached_on(n, r2.id, s) > 0 for n, s in holders])  # kept for a third turn
            await _turn(c, [{"role": "user", "content": "Name a colour."}], params)
            assert all([await _cached_on(n, again.id, s) > 0 for n, s in holders])
            assert not any([await _cached_on(n, r2.id, s) for n, s in holders])  # the oldest kept one went
        for n, s in holders:
            assert await _cached_on(n, again.id, s) == 0
        async with coordinator(nodes, peers=nodes.peers[:2]) as fresh:
            r2b, ids2b, _ = await _turn(fresh, second, params)
            assert r2b.cached_tokens == 0
        assert ids2[:16] == ids2b[:16]

    asyncio.run(run())
