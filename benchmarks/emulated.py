"""Emulated clusters: every strategy's plan measured against its prediction and exo's ring.

    .venv/bin/python benchmarks/emulated.py [--tokens N] [--scenarios a,b] [--model M]

Three node agents on this machine, made unlike each other with tests/helpers/emulation.py (a
cgroup CPU quota where root, else nice 19; a userspace TCP relay for a link's delay and
bandwidth). Scenarios:

* ``slow-node``: one node held to a quarter of a core;
* ``slow-link``: one node behind a relay that holds each direction 10 ms;
* ``wifi-node``: one node behind a Wi-Fi-like relay, 5 ms and 100 Mbit/s each way;
* ``memory-bound``: every node under a ``--memory-limit`` at which exo's ring just fits (its last
  node holds 11 layers and the head) beside the runtime's growth: no node holds the model alone,
  two can.

In each scenario one coordinator first serves exo's ring (every node and link measured), then
plans each strategy on the measured figures (exo_tui/scheduler/calibration.py) and serves it:
a warm-up answer, then ``--answers`` answers of ``--tokens`` tokens, one at a time; the
strategies take turns for ``--rounds`` rounds (the machine's load drifts). Each round plans a
strategy again on the figures measured so far, as a coordinator serving that strategy all along
would: its plan of the round before stays unless one is predicted ``KEEP_GAIN`` better
(exo_tui/scheduler/partition.py), the re-plan's hysteresis (the strategies taking turns, the plan
in force when a strategy's turn comes is another strategy's). Reported per plan: its layers, the
medians of predicted and measured tok/s (one stream, decode, speculative decoding off: the
predictions are of one token a step) and time to first token (each answer's prompt its own, so
none reuses a cached one), the median of each answer's measured over its plan's prediction, and
measured tok/s over exo's ring measured in the same scenario.
Timings on a shared machine are noisy: the ratios are measured side by side, one scenario at a
time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quick import parse  # noqa: E402
from exo_tui.cluster.room import is_refusal  # noqa: E402
from exo_tui.cluster.view import ChatParams  # noqa: E402
from exo_tui.net.errors import RemoteError  # noqa: E402
from exo_tui.scheduler.diff import preview_change  # noqa: E402
from exo_tui.scheduler.prediction import predict  # noqa: E402
from tests.helpers.emulation import CpuQuota, Relay, cpu_quota_unavailable, slow_down  # noqa: E402
from tests.integration.cluster_helpers import cluster_config, coordinator, node_processes  # noqa: E402

SCENARIOS = ("slow-node", "slow-link", "wifi-node", "memory-bound")
STRATEGIES = ("exo-ring", "latency", "throughput", "memory")
PROMPT = "Write a short paragraph about the history of the bicycle, its inventors and how it changed cities."
MEMORY_BOUND_GB = 0.19  # SmolLM2-135M (98 MB held) at 1,024 tokens: exo's ring just fits; one node cannot hold it


@contextmanager
def scenario(name: str, home: Path) -> Iterator[tuple[object, list[str], str]]:
    """The node set, the peers the coordinator is given (one maybe behind a relay), and a note."""
    limits = [MEMORY_BOUND_GB] * 3 if name == "memory-bound" else None
    with ExitStack() as stack:
        nodes = stack.enter_context(node_processes(home, ["onnx"] * 3, memory_limits_gb=limits))
        peers = [f"127.0.0.1:{n.port}" for n in nodes.nodes]
        note = ""
        if name == "slow-node":
            if cpu_quota_unavailable() is None:
                stack.enter_context(CpuQuota(nodes.nodes[2].pid, 0.25))
                note = "node 3 held to 0.25 core (cgroup)"
            else:
                slow_down(nodes.nodes[2].pid)
                note = f"node 3 at nice 19 ({cpu_quota_unavailable()})"
        elif name in ("slow-link", "wifi-node"):
            delay, mbit = (10.0, 0.0) if name == "slow-link" else (5.0, 100.0)
            relay = stack.enter_context(Relay(nodes.nodes[2].address, delay_ms=delay, mbit=mbit))
            peers[2] = relay.address
            note = f"node 3 behind a relay: {delay:g} ms" + (f", {mbit:g} Mbit/s" if mbit else "") + " each way"
        elif name == "memory-bound":
            note = f"every node --memory-limit {MEMORY_BOUND_GB} GB"
        yield nodes, peers, note


_ASKED = [0]


def _prompt(n: int) -> str:
    """The prompt of answer ``n``: its number first, so no answer reuses another's cached prompt."""
    return f"{n}. {PROMPT}"


async def _answer(c: object, tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) of one answer."""
    _ASKED[0] += 1
    start = time.monotonic()
    first = last = None
    n = 0
    async for chunk in c.chat([{"role": "user", "content": _prompt(_ASKED[0])}],  # type: ignore[attr-defined]
                              ChatParams(temperature=0.0, max_tokens=tokens, seed=1)):
        if chunk.error:
            raise RuntimeError(chunk.error)
        for _ in chunk.token_ids:
            now = time.monotonic()
            first = first if first is not None else now
            last = now
            n += 1
    assert first is not None and last is not None and n > 1
    return first - start, (n - 1) / (last - first)


def run_scenario(name: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, scenario(name, Path(tmp) / "home") as (nodes, peers, note):
        return asyncio.run(_serve_each(name, note, nodes, peers, args))


async def _serve_each(name: str, note: str, nodes: object, peers: list[str], args: argparse.Namespace) -> list[dict]:
    """One coordinator: exo's ring served first (every node and link measured), then each strategy
    planned on the measured figures, predicted right after its switch, then measured."""
    rows: list[dict] = []
    config = cluster_config()
    config.models.context_length = args.context
    async with coordinator(nodes, model=args.model, peers=peers, strategy="exo-ring", config=config) as c:  # type: ignore[arg-type]
        c.speculative = "off"  # the predictions are of one token a step
        for _ in range(2):
            await _answer(c, args.tokens)  # measured: every node and link of the ring
        prompt = len(c.model.chat_prompt_ids([{"role": "user", "content": _prompt(100)}]))
        runs: dict[str, list[tuple[str, float, float, float, float]]] = {}
        errors: dict[str, str] = {}
        kept: dict[str, object] = {}  # each strategy's plan of the round before
        for _ in range(args.rounds):  # the strategies in turn, round after round: the machine's load drifts
            for strategy in STRATEGIES:
                c.strategy = strategy
                try:
                    await _replan(c, strategy, kept.get(strategy))
                except Exception as exc:  # noqa: BLE001 - an infeasible plan is a result of the scenario
                    errors[strategy] = str(exc)[:120]
                    continue
                plan = kept[strategy] = c.plan
                pred = predict(plan.shards, {p.node_id: p for p in c.device_profiles()}, c.spec, c.config.scheduler,
                               prompt, c.constraints().coordinator_s,
                               c.constraints().coordinator_links, c.constraints().handed_share)
                await _answer(c, 8)  # warm-up
                for _ in range(args.answers):
                    ttft, tps = await _answer(c, args.tokens)
                    runs.setdefault(strategy, []).append((_layout(c, plan), pred.tok_per_s_single, tps, pred.ttft_s, ttft))
        for strategy in STRATEGIES:
            got = runs.get(strategy)
            if not got:
                rows.append({"scenario": name, "note": note, "strategy": strategy, "error": errors.get(strategy, "no plan")})
                continue
            med = [statistics.median(g[i] for g in got) for i in range(1, 5)]
            rows.append({"scenario": name, "note": note, "strategy": strategy,
                         "layout": " / ".join(dict.fromkeys(g[0] for g in got)),  # in the order served
                         "pred_tps": med[0], "tps": med[1], "pred_ttft": med[2], "ttft": med[3],
                         "ratio": statistics.median(g[2] / g[1] for g in got)})
    return rows


async def _replan(c: object, strategy: str, before: object | None) -> None:
    """``c`` switched to ``strategy``'s plan on the figures measured so far, ``before`` (the
    strategy's plan of the round before) kept unless one is predicted KEEP_GAIN better: the
    hysteresis a re-plan has against the plan in force, here against the plan this strategy
    serves, as it would have on a coordinator serving only this strategy."""
    if before is None:
        await c.replan(f"benchmark: {strategy}")  # type: ignore[attr-defined]
        return
    preview = preview_change(before, c.device_profiles(), c.spec, c.constraints(),  # type: ignore[attr-defined]
                             c.config.scheduler, now=time.monotonic(), strategy=strategy)  # type: ignore[attr-defined]
    if preview.new_plan is None:
        raise RuntimeError(preview.error)
    try:
        await c._switch(preview.new_plan, f"benchmark: {strategy}")  # type: ignore[attr-defined]  # noqa: SLF001
    except RemoteError as exc:  # a load refused for want of room: planned again with the room it reported
        if not is_refusal(exc):
            raise
        await c.replan(f"benchmark: {strategy}")  # type: ignore[attr-defined]


def _layout(c: object, plan: object) -> str:
    """The plan's layers by node name (node 1, 2, 3 as started)."""
    names = {nid: f"n{i + 1}" for i, nid in enumerate(sorted(c.nodes, key=lambda n: c.nodes[n].name))}  # type: ignore[attr-defined]
    return " ".join(f"{names[s.node_id]}[{s.start},{s.end})" for s in plan.shards)  # type: ignore[attr-defined]


def _table(rows: list[dict]) -> str:
    out = ["| scenario | strategy | plan | predicted tok/s | measured tok/s | measured ÷ predicted | ÷ exo-ring measured "
           "| predicted TTFT | measured TTFT |", "|---|---|---|---|---|---|---|---|---|"]
    ring = {r["scenario"]: r.get("tps") for r in rows if r["strategy"] == "exo-ring"}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['scenario']} | {r['strategy']} | infeasible: {r['error']} | | | | | | |")
            continue
        base = ring.get(r["scenario"])
        vs = f"×{r['tps'] / base:.2f}" if base else "–"
        out.append(f"| {r['scenario']} | {r['strategy']} | {r['layout']} | {r['pred_tps']:.1f} | {r['tps']:.1f} | "
                   f"{r['ratio']:.2f} | {vs} | {r['pred_ttft'] * 1000:.0f} ms | {r['ttft'] * 1000:.0f} ms |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--answers", type=int, default=2, help="answers a plan serves in a round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every strategy in turn (medians over them)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--model", default=None, help="default: smollm2-135m")
    args = parse(p, scenarios="slow-link", tokens=8, answers=1, rounds=1)
    os.environ.setdefault("EXO_TUI_LOG_LEVEL", "warning")
    rows: list[dict] = []
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            p.error(f"unknown scenario {name!r}: use {', '.join(SCENARIOS)}")
        rows += run_scenario(name, args)
        print(f"{name}: {rows[-1].get('note', '')}", file=sys.stderr, flush=True)
    notes = {r["scenario"]: r["note"] for r in rows}
    print("\n".join(f"- {k}: {v}" for k, v in notes.items()))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
