"""Measured figures and ``GET /metrics`` on two real node processes (issue 30).

One pair of node agents serves the module; each test starts its own coordinator over them (the
last test kills one of them).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exo_tui.api.server import ApiServer
from exo_tui.cluster.coordinator import Coordinator
from exo_tui.cluster.view import ChatParams, Command
from tests.integration.cluster_helpers import coordinator, node_processes

pytestmark = pytest.mark.slow

PROMPT = "Tell me a short story about a robot who learns to paint."
KEY = "metrics-key"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("exo-home")
    os.environ["EXO_TUI_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def pair(home: Path):
    with node_processes(home, ["onnx", "onnx"]) as ns:
        yield ns


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, parsed by prometheus_client: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items())]
    assert len(hits) == 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0]


async def _answer(c: Coordinator, n: int) -> list[int]:
    """n tokens, a decode step each: speculation off, as these tests count and time one-token steps."""
    tokens: list[int] = []
    async for chunk in c.chat([{"role": "user", "content": PROMPT}], ChatParams(temperature=0.0, max_tokens=n, seed=7, speculative="off")):
        tokens.extend(chunk.token_ids)
        assert chunk.finish_reason in (None, "stop", "length"), chunk.error
    return tokens


def test_stage_times_agree_with_the_nodes_own_and_the_heavier_stage_is_slowest(pair) -> None:
    """Node 0 holds 28 of the 30 layers: the frames' stage times say it is the slowest stage, and
    each node's stage time from the frames agrees with the node's own timing of the same steps."""

    async def run() -> None:
        async with coordinator(pair) as c:
            ids = [s.node_id for s in c.plan.shards]
            heavy = ids[0]
            preview = await c.preview(Command("pin", (heavy,), (0, 28)))
            assert not preview.error, preview.error
            assert not (await c.apply(preview)).error
            before = {n: (c.nodes[n].metrics.get("decode_steps", 0), c.nodes[n].metrics.get("decode_compute_s", 0.0)) for n in ids}
            steps0 = dict(c.metrics.node_steps_total)
            compute0 = dict(c.metrics.node_compute_total)
            tokens = await _answer(c, 40)
            assert len(tokens) == 40
            steps = {n: c.metrics.node_steps_total[n] - steps0.get(n, 0) for n in ids}
            assert all(s == len(tokens) - 1 for s in steps.values()), steps  # every decode step, on both nodes
            for _ in range(100):  # the nodes' counters come with their next heartbeats
                if all(c.nodes[n].metrics.get("decode_steps", 0) - before[n][0] >= steps[n] for n in ids):
                    break
                await asyncio.sleep(0.1)
            figures = c.figures()
            for n in ids:
                own_steps = c.nodes[n].metrics["decode_steps"] - before[n][0]
                own = (c.nodes[n].metrics["decode_compute_s"] - before[n][1]) / own_steps
                measured = (c.metrics.node_compute_total[n] - compute0.get(n, 0.0)) / steps[n]
                assert own_steps == steps[n]
                assert abs(measured - own) <= 0.10 * own, (n, measured, own)
            stage = {n: figures.node(n).stage_s for n in ids}
            assert stage[heavy] == max(stage.values()), stage
            assert figures.balance is not None and figures.balance > 0
            assert figures.token_s is not None and figures.token_s >= sum(stage.values())
            assert 0 < figures.comm_share < 1
            share = figures.node(heavy).token_share
            assert share is not None and 0 < share < 1 and figures.node(heavy).idle_share == pytest.approx(1 - share)
            assert figures.measured_tok_per_s and figures.predicted_tok_per_s
            on_path = [x for x in figures.links if x.ring_s is not None]
            # the coordinator sends a lease's first step, the last node hands the others' tokens to the first
            assert [(x.src, x.dst) for x in on_path] == [("coordinator", ids[0]), (ids[0], ids[1]), (ids[1], "coordinator"),
                                                         (ids[1], ids[0])]

            # The answer has ended, its caches kept for a next turn: the last node (which sampled
            # its tokens) still lists the request, and within a few heartbeats shows no tok/s for
            # it (its average stayed on the node, a drained one too, until the cache went).
            def idle() -> bool:
                return bool(c.nodes[ids[-1]].metrics.get("requests")) and all(c.nodes[n].tok_per_s == 0.0 for n in ids)

            for _ in range(200):
                if idle():
                    break
                await asyncio.sleep(0.1)
            assert idle(), {n: c.nodes[n].metrics.get("requests") for n in ids}

    asyncio.run(run())


def test_scrape_during_a_stream_then_a_drain_and_a_kill_9(pair, home: Path) -> None:
    async def run() -> None:
        async with coordinator(pair) as c:
            api = ApiServer(c, port=0, api_key=KEY)
            await api.start()
            headers = {"Authorization": f"Bearer {KEY}"}
            ids = [s.node_id for s in c.plan.shards]
            names = {n: c.nodes[n].name for n in ids}
            try:
                async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=120) as http:
                    assert (await http.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
                    scrapes: list[dict] = []

                    async def stream(n: int, during=None) -> int:  # noqa: ANN001
                        body = {"model": c.model.name, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                                "max_tokens": n, "temperature": 0, "seed": 7, "stream_options": {"include_usage": True}}
                        tokens, usage, acted = 0, None, False
                        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                            assert r.status_code == 200
                            async for line in r.aiter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                d = json.loads(line[6:])
                                if d.get("usage"):
                                    usage = d["usage"]
                                if d.get("choices") and d["choices"][0]["delta"].get("content"):
                                    tokens += 1
                                    if tokens in (5, 15):
                                        scrapes.append(_samples((await http.get("/metrics")).text))
                                    if tokens == 10 and during is not None and not acted:
                                        acted = True
                                        await during()
                        return usage["completion_tokens"]

                    # a node's figures are its heartbeats' (left out until the first): wait for one each
                    for _ in range(600):
                        if all("cpu_percent" in c.nodes[n].metrics for n in ids):
                            break
                        await asyncio.sleep(0.05)
                    n1 = await stream(40)
                    mid1, mid2 = scrapes[-2:]
                    assert _value(mid2, "exo_tui_generation_tokens_total") > _value(mid1, "exo_tui_generation_tokens_total")
                    assert _value(mid2, "exo_tui_requests_running", model=c.model.name) == 1
                    assert _value(mid2, "exo_tui_requests_queued") == 0
                    for n in ids:  # per-node series for both nodes, while the answer streams
                        assert _value(mid2, "exo_tui_node_up", node=names[n]) == 1
                        assert _value(mid2, "exo_tui_node_decode_steps_total", node=names[n]) > \
                            _value(mid1, "exo_tui_node_decode_steps_total", node=names[n])
                        assert _value(mid2, "exo_tui_node_stage_seconds", node=names[n]) > 0
                        assert _value(mid2, "exo_tui_node_cpu_percent", node=names[n]) >= 0
                    after = _samples((await http.get("/metrics")).text)
                    assert _value(after, "exo_tui_requests_total", outcome="completed") == 1
                    assert _value(after, "exo_tui_time_to_first_token_seconds_count") == 1
                    assert _value(after, "exo_tui_inter_token_latency_seconds_count") == n1 - 1
                    assert _value(after, "exo_tui_inter_token_latency_seconds_bucket", le="+Inf") == n1 - 1
                    assert _value(after, "exo_tui_generation_tokens_total") == n1
                    assert _value(after, "exo_tui_requests_running") == 0

                    drained = ids[1]

                    async def drain() -> None:
                        r = await http.post(f"/v1/cluster/nodes/{names[drained]}/drain")
                        assert r.status_code == 200, r.text

                    n2 = await stream(40, drain)
                    s = _samples((await http.get("/metrics")).text)
                    assert _value(s, "exo_tui_node_info", node=names[drained], state="drained") == 1
                    assert _value(s, "exo_tui_plan_changes_total") >= 1
                    assert _value(s, "exo_tui_requests_total", outcome="completed") == 2
                    assert _value(s, "exo_tui_generation_tokens_total") == n1 + n2
                    assert (await http.post(f"/v1/cluster/nodes/{names[drained]}/undrain")).status_code == 200

                    victim = c.plan.shards[0].node_id
                    proc = next(p for p in pair.nodes if p.port == c.nodes[victim].port)

                    async def kill() -> None:
                        os.kill(proc.pid, signal.SIGKILL)

                    failed_before = _value(s, "exo_tui_requests_total", outcome="failed")
                    n3 = await stream(40, kill)
                    assert n3 == 40  # resumed on the survivor
                    s = _samples((await http.get("/metrics")).text)
                    assert _value(s, "exo_tui_node_up", node=names[victim]) == 0
                    assert _value(s, "exo_tui_node_info", node=names[victim], state="failed") == 1
                    assert _value(s, "exo_tui_node_failures_total", node=names[victim]) == 1
                    assert _value(s, "exo_tui_requests_total", outcome="failed") == failed_before == 0
                    assert _value(s, "exo_tui_requests_total", outcome="completed") == 3
                    assert _value(s, "exo_tui_inter_token_latency_seconds_count") == n1 + n2 + n3 - 3
                    figures = c.figures()
                    assert figures.completed == 3 and figures.failed == 0 and figures.success_rate == 1.0
                    assert figures.node(victim) is not None and not figures.node(victim).up
            finally:
                await api.stop()

    asyncio.run(run())
