"""Decode speed of one stream through 1, 2, 3 and 4 node processes on loopback, TLS on and off,
on uvloop and on asyncio's own event loop (coordinator and nodes alike, ``EXO_TUI_EVENT_LOOP``).

For each loop and TLS setting, one real coordinator per node count runs with ``--local-nodes N``
(the same backend on every node, layers split evenly), all of them up at once, and they take turns:
each round every cluster decodes one greedy stream of ``--tokens`` tokens of the default model.
Medians over all rounds' decode steps are reported. Taking turns in short blocks matters on a
shared machine, whose speed drifts by 10-15 % over minutes: measured one configuration after the
other, that drift lands in the ratios. The per-hop time is what each extra node adds to a decode
step: ``(step(N) - step(1)) / (N - 1)``.

    python benchmarks/pipeline.py [--backend onnx] [--tokens 48] [--rounds 5] [--nodes 1,2,3,4]
                                  [--loops uvloop,asyncio] [--pin off|on|off,on]

``--pin off,on`` also runs every cluster with the ONNX backend's core pinning on
(``EXO_TUI_ONNX_PIN=1``, see ``backends/onnx/affinity.py``), side by side with it off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PIN_ENV = "EXO_TUI_ONNX_PIN"

if TYPE_CHECKING:
    from exo_tui.cluster.coordinator import Coordinator


async def _steps(c: Coordinator, tokens: int) -> list[float]:
    """Seconds between tokens of one greedy stream (the first two, prefill and warm-up, left out)."""
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    prompt = c.model.chat_prompt_ids([{"role": "user", "content": "Write a long poem about the sea."}])
    request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
    stamps: list[float] = []
    async for chunk in c.generate(request):
        if chunk.token_id is not None:
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[2:], stamps[3:], strict=False)]


async def _group(
    counts: list[int], pins: list[str], backend: str, tls: bool, tokens: int, rounds: int, home: Path
) -> dict[tuple[str, int], float]:
    """Median seconds per decode step for each pinning setting and node count, the clusters
    taking turns."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.config import Config

    config = Config()
    config.network.security.enable_tls = tls
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0
    coordinators: dict[tuple[str, int], Coordinator] = {}
    try:
        for pin in pins:
            os.environ[PIN_ENV] = "1" if pin == "on" else "0"  # the node processes read it at start
            for n in counts:
                c = Coordinator(local_nodes=n, local_backends=[backend], strategy="even", config=config,
                                home=home / f"{n}-nodes-pin-{pin}", persist=False)
                await c.start()
                coordinators[(pin, n)] = c
        gaps: dict[tuple[str, int], list[float]] = {k: [] for k in coordinators}
        for _ in range(rounds):
            for k, c in coordinators.items():
                gaps[k] += await _steps(c, tokens)
        return {k: statistics.median(g) for k, g in gaps.items()}
    finally:
        for c in coordinators.values():
            await c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="turns each cluster takes")
    ap.add_argument("--nodes", default="1,2,3,4")
    ap.add_argument("--loops", default="uvloop,asyncio", help="event loops to compare (uvloop needs uvloop installed)")
    ap.add_argument("--pin", default="off", help="ONNX core pinning to compare: off, on or off,on (EXO_TUI_ONNX_PIN)")
    args = ap.parse_args()
    from exo_tui.net import loop as event_loop

    counts = [int(x) for x in args.nodes.split(",")]
    loops = args.loops.split(",")
    pins = args.pin.split(",")
    if not set(pins) <= {"on", "off"}:
        ap.error("--pin takes off, on or off,on")
    med: dict[tuple[str, bool, str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        for loop in loops:
            os.environ[event_loop.ENV] = loop  # node processes inherit it
            for tls in (True, False):
                home = Path(d) / f"{loop}-{'tls' if tls else 'plain'}"
                steps = event_loop.run(_group(counts, pins, args.backend, tls, args.tokens, args.rounds, home))
                for (pin, n), step in steps.items():
                    med[(loop, tls, pin, n)] = step
    print(f"\nDecode of the default model, one stream, {args.backend} on every node, loopback, "
          f"the clusters taking turns, {args.rounds} streams of {args.tokens} tokens each, medians\n")
    print("| loop | TLS | pinned | nodes | ms/token | tok/s | ÷ 1 node | per extra hop, ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for loop in loops:
        for tls in (True, False):
            for pin in pins:
                one = med.get((loop, tls, pin, 1))
                for n in counts:
                    s = med[(loop, tls, pin, n)]
                    ratio = f"{one / s:.2f}" if one else "–"
                    hop = f"{(s - one) / (n - 1) * 1000:.2f}" if one and n > 1 else "–"
                    print(f"| {loop} | {'on' if tls else 'off'} | {pin} | {n} | {s * 1000:.1f} | {1 / s:.1f} | {ratio} | {hop} |")


if __name__ == "__main__":
    main()
