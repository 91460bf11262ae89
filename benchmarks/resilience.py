"""What a stream feels when the cluster changes under it: the longest gap between two streamed
tokens (the stall) and the time until tokens flow at full speed again, for a drain, a rebalance
and ``kill -9`` of the first, middle and last node of a 3-node ring (default model, loopback), and
``kill -9`` of the leader of three coordinators while the stream runs through a standby (its stall,
and the time until a new leader is in charge: see benchmarks/_coordinator_kill.py).

    python benchmarks/resilience.py [--backend onnx] [--tokens 120] [--at 30] [--only "coordinator kill -9"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402
from exo_tui.net import loop as event_loop  # noqa: E402

SCENARIOS = ("none", "drain", "rebalance", "kill first", "kill middle", "kill last", "coordinator kill -9")


async def _run(scenario: str, backend: str, tokens: int, at: int, home: Path) -> tuple[float, float, float]:
    """(baseline gap, stall, time to full speed) in seconds."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.config import Config
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    config = Config()
    strategy = "throughput" if scenario == "rebalance" else "even"
    c = Coordinator(local_nodes=3, local_backends=[backend], strategy=strategy, config=config, home=home, persist=False)
    await c.start()
    try:
        prompt = c.model.chat_prompt_ids([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
        request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
        stamps: list[float] = []
        event_at = None
        action: asyncio.Task | None = None
        async for chunk in c.generate(request):
            if chunk.token_id is None:
                continue
            stamps.append(time.perf_counter())
            if len(stamps) == at and scenario != "none":
                event_at = time.perf_counter()
                action = asyncio.create_task(_disturb(c, scenario))
        if action is not None:
            await action
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        base = statistics.median(gaps[2 : at - 1])
        if event_at is None:
            return base, max(gaps[2:]), 0.0
        after = [(t, g) for t, g in zip(stamps[1:], gaps, strict=False) if t > event_at]
        stall = max(g for _, g in after)
        recovered = event_at
        for t, g in after:
            if g > 1.5 * base:
                recovered = t
        return base, stall, recovered - event_at
    finally:
        await c.stop()


async def _disturb(c, scenario: str) -> None:  # noqa: ANN001
    from exo_tui.cluster.view import Command

    if scenario in ("drain", "rebalance"):
        target = (c.plan.shards[1].node_id,) if scenario == "drain" else ()
        result = await c.apply(await c.preview(Command(scenario, target)))
        if result.error:
            print(f"{scenario}: {result.error}", file=sys.stderr)
        return
    index = {"kill first": 0, "kill middle": 1, "kill last": 2}[scenario]
    handle = c.nodes[c.plan.shards[index].node_id]
    os.kill(handle.local_process.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--at", type=int, default=30, help="token at which the disturbance happens")
    ap.add_argument("--only", action="append", choices=SCENARIOS, help="run only these scenarios (repeatable)")
    args = parse(ap, tokens=12, at=5, only=["drain"])
    rows: list[tuple[str, float, float, float | None]] = []
    leader_s = None
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        for scenario in args.only or SCENARIOS:
            if scenario == "coordinator kill -9":
                from _coordinator_kill import run as coordinator_kill  # beside this script

                with tempfile.TemporaryDirectory(prefix="exo-bench-set-") as h:
                    base, stall, leader_s, _ = coordinator_kill(args.backend, args.tokens, args.at, Path(h))
                rows.append((scenario, base, stall, None))
                continue
            base, stall, recover = event_loop.run(_run(scenario, args.backend, args.tokens, args.at, Path(d)))
            rows.append((scenario, base, stall, recover))
    print(f"\nOne greedy stream of the default model on 3 {args.backend} nodes (loopback); "
          f"disturbance at token {args.at}\n")
    print("| event | normal gap, ms | stall, ms | stall ÷ normal | back to full speed after, s |")
    print("|---|---:|---:|---:|---:|")
    for scenario, base, stall, recover in rows:
        back = "–" if recover is None else f"{recover:.2f}"
        print(f"| {scenario} | {base * 1000:.0f} | {stall * 1000:.0f} | {stall / base:.1f} | {back} |")
    if leader_s is not None:
        print(f"\ncoordinator kill -9: a new leader in charge {leader_s:.2f} s after the kill (goal: the stream's "
              "stall under 3 s)")


if __name__ == "__main__":
    main()
