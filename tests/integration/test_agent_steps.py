"""How a node agent runs forward steps: a lone stream's decode steps run at once on the event
loop (inline), steps of several requests run as one batch, a batch waits a bounded while for a
step due back, and a batch stays whole on the next hop.

Real node agents in this process (ONNX, a tiny random model) on loopback, driven by a test
coordinator that sends forward frames and collects the tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest

from exo_tui.inference.sampling import TokenLogprobs, scores_from_array
from exo_tui.net import Cluster, Dispatcher, Frame, RemoteError, Security, connect, ensure_cluster
from exo_tui.net import messages as wire
from exo_tui.net.codec import call
from exo_tui.net.protocol import FILLED
from exo_tui.node.agent import NodeAgent
from exo_tui.node.batching import GatherPolicy

PROMPT = np.array([1, 5, 9, 14, 3, 7, 2, 11, 8, 4, 6, 10], dtype=np.int64)  # longer than INLINE_MAX_ROWS
GREEDY = {"temperature": 0.0}
DECODE_STEPS = 5


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("EXO_TUI_HOME", str(tmp_path / "home"))
    return ensure_cluster()


class Ring:
    """Node agents holding a tiny model's layers in a ring, and a coordinator's connection to each."""

    def __init__(self, cluster: Cluster, model: Path) -> None:
        self.cluster = cluster
        self.model = model
        self.agents: list[NodeAgent] = []
        self.conns = []
        self.tokens: dict[tuple[str, int], asyncio.Future[int]] = {}
        self.failures: list[dict] = []
        self.bodies: dict[tuple[str, int], dict] = {}  # each token frame's body
        self.tensors: dict[tuple[str, int], np.ndarray | None] = {}  # and its tensor
        self.version = 1

    async def start(self, splits: list[tuple[int, int]], policy: GatherPolicy | None = None) -> None:
        handler = Dispatcher()

        @handler.route("token")
        async def token(conn, f: Frame) -> None:
            self.bodies[f.body["rid"], f.body["step"]] = f.body
            self.tensors[f.body["rid"], f.body["step"]] = f.tensor
            self._future(f.body["rid"], f.body["step"]).set_result(int(f.body["token"]))

        @handler.route("step_failed")
        async def failed(conn, f: Frame) -> None:
            self.failures.append(f.body)

        @handler.route("heartbeat")
        async def heartbeat(conn, f: Frame) -> None:
            pass

        ring = []
        for i, (start, end) in enumerate(splits):
            agent = NodeAgent(name=f"steps-{i}", host="127.0.0.1", port=0, backend="onnx", run_benchmark=False,
                              security=Security.from_bundle(self.cluster.node_bundle(f"steps-{i}")))
            if policy is not None:
                agent.executor.batching.policy = policy
            await agent.start()
            self.agents.append(agent)
            conn = await connect("127.0.0.1", agent.port, security=self.cluster.security(), handler=handler)
            self.conns.append(conn)
            await conn.call("attach")
            await conn.call("load", {"path": str(self.model), "start": start, "end": end, "backend": "onnx"}, timeout=60)
            ring.append({"node_id": agent.profile.node_id, "host": "127.0.0.1", "port": agent.port,
                         "start": start, "end": end, "backend": "onnx"})
        plan = {"version": self.version, "n_layers": splits[-1][1], "ring": ring}
        for conn in self.conns:
            await conn.call("plan", {"plan": plan})

    async def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                await conn.aclose()
        for agent in self.agents:
            await agent.stop()

    def _future(self, rid: str, step: int) -> asyncio.Future[int]:
        key = (rid, step)
        if key not in self.tokens:
            self.tokens[key] = asyncio.get_running_loop().create_future()
        return self.tokens[key]

    async def send(self, rid: str, tokens: list[int], pos: int, **extra: object) -> None:
        step = len(tokens) - len(PROMPT)
        body = {"rid": rid, "hop": 0, "pos": pos, "step": step, "n_tokens": len(tokens), "sampling": GREEDY, **extra}
        self._future(rid, step)
        await self.conns[0].send("forward", body, tensor=np.asarray(tokens[pos:], dtype=np.int64), plan=self.version)

    async def token(self, rid: str, step: int) -> int:
        async with asyncio.timeout(30):
            return await self._future(rid, step)

    async def prefill(self, rids: list[str]) -> dict[str, list[int]]:
        histories = {}
        for rid in rids:
            tokens = [int(t) for t in PROMPT]
            await self.send(rid, tokens, 0)
            tokens.append(await self.token(rid, 0))
            histories[rid] = tokens
        return histories

    async def decode_round(self, histories: dict[str, list[int]], straggler_delay_s: float = 0.0,
                           gap_s: float = 0.0) -> None:
        """One decode step of every request, sent back to back (``gap_s`` apart; the last one
        after a delay)."""
        rids = list(histories)
        for i, rid in enumerate(rids):
            if straggler_delay_s and i == len(rids) - 1:
                await asyncio.sleep(straggler_delay_s)
            elif gap_s and i:
                await asyncio.sleep(gap_s)
            tokens = histories[rid]
            await self.send(rid, tokens, len(tokens) - 1)
        for rid in rids:
            tokens = histories[rid]
            tokens.append(await self.token(rid, len(tokens) - len(PROMPT)))

    async def end(self, rids: list[str]) -> None:
        for conn in self.conns:
            for rid in rids:
                await conn.call("drop", {"rid": rid, "final": True})


@contextlib.asynccontextmanager
async def ring(cluster: Cluster, model: Path, splits: list[tuple[int, int]], policy: GatherPolicy | None = None):
    r = Ring(cluster, model)
    try:
        await r.start(splits, policy)
        yield r
    finally:
        await r.stop()


async def test_lone_stream_steps_run_inline_and_a_prefill_does_not(cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 4)]) as r:
        node = r.agents[0]
        history = (await r.prefill(["solo"]))["solo"]
        assert node.executor.inline_steps == 0  # the prompt ran on the worker thread
        for _ in range(DECODE_STEPS):
            await r.decode_round({"solo": history})
        assert node.executor.inline_steps == DECODE_STEPS
        assert dict(node.executor.batch_sizes) == {1: 1 + DECODE_STEPS}
        assert not r.failures
        assert node.executor.batching.shared_cores  # its plan reaches every hop on loopback: one machine's cores


async def test_a_step_that_comes_while_the_run_before_it_delivers_waits_for_it(cluster: Cluster, tiny_model: Path):
    """The next step of a request can arrive after the worker ran the step before it but before
    that step's result went on (its run's delivery awaits): run inline then, it went on first and
    overtook it at the next node ('positions start at 12 but the request has 0 cached tokens').
    Here the first node's delivery of the prompt's step is held until the next step has arrived."""
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        node = r.agents[0].executor
        delivering, release, second_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
        deliver, arrived = node.deliver, node.arrived

        async def held(step, result, more):  # noqa: ANN001, ANN202 - the executor's Deliver
            if step.body.rid == "race" and not delivering.is_set():
                delivering.set()
                await release.wait()
            await deliver(step, result, more)

        async def seen(step, *, next_ready):  # noqa: ANN001, ANN202
            await arrived(step, next_ready=next_ready)
            if step.body.rid == "race" and step.body.step == 1:
                second_in.set()

        await r.prefill(["warm"])  # the first node's link to the second is up
        await r.end(["warm"])
        node.deliver, node.arrived = held, seen  # type: ignore[method-assign]
        tokens = [int(t) for t in PROMPT]
        await r.send("race", tokens, 0)  # 12 rows: run on the worker
        async with asyncio.timeout(30):
            await delivering.wait()
        await r.send("race", [*tokens, 3], len(tokens))  # the next step, of one row: inline-sized
        async with asyncio.timeout(30):
            await second_in.wait()
        inline = node.inline_steps
        release.set()
        await r.token("race", 0)
        await r.token("race", 1)
        assert not r.failures, r.failures
        assert inline == 0  # it waited in the queue for the run before it


async def test_steps_of_several_requests_run_as_one_batch_with_their_solo_tokens(cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 4)]) as r:
        node = r.agents[0]
        solo = (await r.prefill(["solo"]))["solo"]
        for _ in range(DECODE_STEPS):
            await r.decode_round({"solo": solo})
        await r.end(["solo"])
        rids = [f"r{i}" for i in range(4)]
        histories = await r.prefill(rids)
        before = node.executor.inline_steps
        for _ in range(DECODE_STEPS):
            await r.decode_round(histories)
        assert node.executor.inline_steps == before  # other requests are active: no step ran inline
        assert node.executor.batch_sizes[4] == DECODE_STEPS
        assert all(h == solo for h in histories.values()), (solo, histories)
        # once they have ended, a lone stream runs inline again
        await r.end(rids)
        lone = (await r.prefill(["late"]))["late"]
        await r.decode_round({"late": lone})
        assert node.executor.inline_steps == before + 1
        assert not r.failures


async def test_a_batch_waits_a_bounded_while_for_a_step_due_back(cluster: Cluster, tiny_model: Path):
    """The rules themselves, with made-up times: tests/unit/test_gather_window.py; here, that a
    real node applies them."""
    # A window of 30 s, for a straggler sent 0.03 s late: it is waited for however slow the
    # machine is (30 s only fails a hung test); the requests count as active just as long.
    async with ring(cluster, tiny_model, [(0, 4)], GatherPolicy(min_s=30.0, max_s=30.0, active_s=30.0)) as r:
        node = r.agents[0]
        histories = await r.prefill([f"r{i}" for i in range(4)])
        for _ in range(3):  # the node learns how long the requests stay away
            await r.decode_round(histories)
        assert node.executor.batch_sizes[4] == 3
        await r.decode_round(histories, straggler_delay_s=0.03)
        assert node.executor.batch_sizes[4] == 4 and node.executor.batch_sizes[3] == 0, dict(node.executor.batch_sizes)
        # a request that does not come back is waited for at most the window: 1 s now, as this
        # step never comes (the three others run as one batch once it ends)
        node.executor.batching.policy = GatherPolicy(min_s=1.0, max_s=1.0, active_s=30.0)
        del histories["r3"]
        await r.decode_round(histories)
        assert node.executor.batch_sizes[3] == 1
        assert not r.failures


async def test_steps_that_trickle_in_form_one_batch(cluster: Cluster, tiny_model: Path):
    """Right after their prompts nothing is known of when the requests come back; steps sent one
    after another (as a coordinator does) still form one batch, and the batch starts once they
    stop coming (``quiet_s``; that it does not wait for the window: the unit tests). Steps 0.01 s
    apart and a quiet time of 1 s: they form one batch however slow the machine is; the window
    and the time a request counts as active (30 s) only fail a hung test."""
    policy = GatherPolicy(min_s=30.0, max_s=30.0, quiet_s=1.0, active_s=30.0)
    async with ring(cluster, tiny_model, [(0, 4)], policy) as r:
        node = r.agents[0]
        histories = await r.prefill([f"r{i}" for i in range(4)])
        await r.decode_round(histories, gap_s=0.01)
        assert node.executor.batch_sizes[4] == 1, dict(node.executor.batch_sizes)
        assert not r.failures


async def test_a_batch_stays_whole_on_the_next_hop(cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        first, second = r.agents
        solo = (await r.prefill(["solo"]))["solo"]
        for _ in range(DECODE_STEPS):
            await r.decode_round({"solo": solo})
        assert (first.executor.inline_steps, second.executor.inline_steps) == (DECODE_STEPS, DECODE_STEPS)
        await r.end(["solo"])
        histories = await r.prefill([f"r{i}" for i in range(4)])
        for _ in range(DECODE_STEPS):
            await r.decode_round(histories)
        assert first.executor.batch_sizes[4] == DECODE_STEPS
        assert second.executor.batch_sizes[4] == DECODE_STEPS, dict(second.executor.batch_sizes)
        assert (first.executor.inline_steps, second.executor.inline_steps) == (DECODE_STEPS, DECODE_STEPS)
        assert all(h == solo for h in histories.values())
        assert not r.failures


async def test_a_verify_step_runs_in_the_pass_of_other_streams_decode_steps(cluster: Cluster, tiny_model: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """Two streams' decode steps and a third's verify step (its last token and 3 drafts, the last
    one wrong), sent back to back: each node runs them as one batch in one pass over its layers
    (on the kernel the verify step's rows are rows of that pass, not deferred as a prompt's nor
    run alone), and every stream gets its solo tokens: the verify step its 2 right drafts and the
    token after them."""
    from backends.onnx import kernels

    if kernels.library() is None:
        pytest.skip("the verify step's rows join a batch on exo-tui's attention kernel")
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        solo = (await r.prefill(["solo"]))["solo"]
        for _ in range(DECODE_STEPS):
            await r.decode_round({"solo": solo})
        await r.end(["solo"])
        histories = await r.prefill(["a", "b", "v"])
        passes: list[str] = []
        for agent in r.agents:
            for hosted in agent.executor.started_host.shards.values():
                shard, run = hosted.shard, hosted.shard._run_bound
                monkeypatch.setattr(shard, "_run_bound", lambda io, run=run, n=agent.name: (passes.append(n), run(io)))
        v = histories.pop("v")
        n = len(v)
        drafts = [solo[n], solo[n + 1], 0 if solo[n + 2] else 1]
        for rid, tokens in histories.items():
            await r.send(rid, tokens, n - 1)
        await r.send("v", v + drafts, n - 1, step=n - len(PROMPT), n_tokens=n, draft=drafts)
        assert [await r.token(rid, n - len(PROMPT)) for rid in ("a", "b")] == [solo[n]] * 2
        assert await r.token("v", n - len(PROMPT)) == solo[n + 2]
        body = r.bodies["v", n - len(PROMPT)]
        assert (body["accepted"], body["tokens"]) == (2, solo[n : n + 3])
        assert sorted(passes) == ["steps-0", "steps-1"], passes  # one pass a node
        assert [agent.executor.batch_sizes[3] for agent in r.agents] == [1, 1]
        assert not r.failures


async def test_a_prompts_chunks_sent_back_to_back_run_one_a_run_in_order(cluster: Cluster, tiny_model: Path):
    """The coordinator sends a long prompt's chunks without waiting for each to come back: queued
    together at a node (here the first frame announces the others, so the node waits for them),
    they run one a run, in order, each on the caches the one before filled, and the last draws the
    token the whole prompt does."""
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        whole = (await r.prefill(["whole"]))["whole"]
        tokens = [int(t) for t in PROMPT]
        for i, (a, b) in enumerate(((0, 4), (4, 8))):
            body = {"rid": "chunked", "hop": 0, "pos": a, "step": -1 - i, "n_tokens": b, "sampling": GREEDY,
                    "fill": True, "more": 2 - i}
            r._future("chunked", -1 - i)
            await r.conns[0].send("forward", body, tensor=np.asarray(tokens[a:b], dtype=np.int64), plan=r.version)
        await r.send("chunked", tokens, 8)  # the last chunk, drawing the first token (step 0)
        assert [await r.token("chunked", s) for s in (-1, -2)] == [FILLED, FILLED]
        assert await r.token("chunked", 0) == whole[len(PROMPT)]
        assert not r.failures, r.failures
        first = r.agents[0]
        assert first.executor.batch_sizes[1] == 4 and not first.executor.batch_sizes[3], dict(first.executor.batch_sizes)  # "whole", then each


async def test_new_prompts_let_the_decode_steps_of_running_streams_go_first(cluster: Cluster, tiny_model: Path):
    """Decode steps and new prompts queued together: the decode steps run (and answer) first, the
    prompts in the next run, all with their solo tokens."""
    async with ring(cluster, tiny_model, [(0, 4)], GatherPolicy(min_s=2.0, max_s=2.0, quiet_s=0.05)) as r:
        node = r.agents[0]
        solo = (await r.prefill(["solo"]))["solo"]
        await r.decode_round({"solo": solo})
        await r.end(["solo"])
        running = await r.prefill(["a", "b"])
        before = dict(node.executor.batch_sizes)
        answered: list[str] = []
        for rid, tokens in running.items():
            await r.send(rid, tokens, len(tokens) - 1)
            r._future(rid, 1).add_done_callback(lambda _, rid=rid: answered.append(rid))
        new = ["n0", "n1", "n2"]
        for rid in new:
            await r.send(rid, [int(t) for t in PROMPT], 0)
            r._future(rid, 0).add_done_callback(lambda _, rid=rid: answered.append(rid))
        assert [await r.token(rid, 1) for rid in running] == [solo[len(PROMPT) + 1]] * 2
        assert [await r.token(rid, 0) for rid in new] == [solo[len(PROMPT)]] * 3
        await asyncio.sleep(0)
        assert sorted(answered[:2]) == ["a", "b"] and sorted(answered[2:]) == new, answered
        runs = {k: v - before.get(k, 0) for k, v in node.executor.batch_sizes.items() if v - before.get(k, 0)}
        assert runs == {2: 1, 3: 1}, runs  # not one run of five
        assert not r.failures


async def test_logprobs_come_back_only_for_the_requests_of_a_batch_that_ask(cluster: Cluster, tiny_model: Path):
    """In one batch: a request asking for 2 alternatives gets its token's logprobs, one that does
    not ask gets none, and one asking for what cannot be (21) fails alone, with the reason."""
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        histories = await r.prefill(["asks", "plain", "bad"])
        asks = {"asks": {"logprobs": 2}, "plain": {}, "bad": {"logprobs": 21}}
        for rid, tokens in histories.items():
            await r.send(rid, tokens, len(tokens) - 1, **asks[rid])
        step = len(histories["asks"]) - len(PROMPT)
        token = await r.token("asks", step)
        await r.token("plain", step)
        assert r.agents[1].executor.batch_sizes[3] == 1, dict(r.agents[1].executor.batch_sizes)
        lp = TokenLogprobs.from_wire(r.bodies["asks", step]["logprobs"])
        assert lp.token == token and len(lp.top) == 2 and lp.top[0] == (token, lp.logprob) and lp.logprob <= 0
        assert "logprobs" not in r.bodies["plain", step]
        async with asyncio.timeout(10):
            while not r.failures:
                await asyncio.sleep(0.01)
        assert [f["rid"] for f in r.failures] == ["bad"]
        assert "top logprobs must be in [0, 20], not 21" in r.failures[0]["error"]


async def test_a_prompt_is_scored_at_the_last_node_and_a_bad_ask_fails_alone(cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        histories = await r.prefill(["plain"])
        targets = [int(t) for t in PROMPT[1:]]
        await r.send("scored", [int(t) for t in PROMPT], 0, score={"top": 1, "targets": targets})
        await r.send("bad", [int(t) for t in PROMPT], 0, score={"top": 1, "targets": [int(t) for t in PROMPT]})
        await r.decode_round(histories)
        await r.token("scored", 0)
        assert r.bodies["scored", 0]["scored"] is True
        scores = scores_from_array(r.tensors["scored", 0])
        assert [s.token for s in scores] == targets
        assert all(s.logprob <= 0 and len(s.top) == 1 and s.top[0][1] >= s.logprob for s in scores)
        assert "scored" not in r.bodies["plain", 1] and r.tensors["plain", 1] is None
        async with asyncio.timeout(10):
            while not r.failures:
                await asyncio.sleep(0.01)
        assert [f["rid"] for f in r.failures] == ["bad"]
        assert "12 tokens to score, but the step runs 12" in r.failures[0]["error"]


async def test_a_malformed_step_gets_one_error_frame_naming_the_field_and_the_node_serves_on(
        cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        coordinator = r.conns[0]
        await r.send("bad", [int(t) for t in PROMPT], 0, hop="0")  # a string where the hop's index goes
        # a well-formed step after it on the same connection: its token comes after the refusal
        history = (await r.prefill(["good"]))["good"]
        await r.decode_round({"good": history})
        assert coordinator.refusals == 1
        assert coordinator.last_refusal is not None and coordinator.last_refusal.code == "bad_body"
        assert str(coordinator.last_refusal) == "forward: field 'hop' must be an int, got str"
        assert not coordinator.is_closed and not r.failures
        assert ("bad", 0) not in r.bodies  # nothing ran for it
        # a call's malformed body is answered with its one error frame, the same way
        with pytest.raises(RemoteError, match="drop: field 'final' must be a bool, got int") as refused:
            await coordinator.call("drop", {"rid": "good", "final": 1})
        assert refused.value.code == "bad_body"
        await r.decode_round({"good": history})
        assert coordinator.refusals == 1 and not r.failures


async def test_a_node_probes_its_link_to_another_with_typed_pings(cluster: Cluster, tiny_model: Path):
    async with ring(cluster, tiny_model, [(0, 2), (2, 4)]) as r:
        probe = wire.LinkProbe("127.0.0.1", r.agents[1].port, pings=2, bandwidth_bytes=1 << 16)
        link = await call(r.conns[0], probe, wire.Link, timeout=30)
        assert link.rtt_s > 0 and link.latency_s == link.rtt_s / 2
        assert link.bandwidth_bytes_per_s is not None and link.bandwidth_bytes_per_s > 0
