"""Decode speed of one stream through 1, 2, 3 and 4 node processes on loopback, TLS on and off,
on uvloop and on asyncio's own event loop (coordinator and nodes alike, ``EXO_TUI_EVENT_LOOP``).

Each configuration runs a real coordinator with ``--local-nodes N`` (the same backend on every
node, layers split evenly) and times greedy decode steps of the default model; configurations
alternate over several rounds and medians are reported. The per-hop time is what each extra node
adds to a decode step: ``(step(N) - step(1)) / (N - 1)``.

    python benchmarks/pipeline.py [--backend onnx] [--tokens 48] [--rounds 3] [--loops uvloop,asyncio]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def _measure(n: int, backend: str, tls: bool, tokens: int, home: Path) -> float:
    """Seconds per decode step (median) for one stream on ``n`` local nodes."""
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.config import Config
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    config = Config()
    config.network.security.enable_tls = tls
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0
    c = Coordinator(local_nodes=n, local_backends=[backend], strategy="even", config=config, home=home, persist=False)
    await c.start()
    try:
        prompt = c.model.chat_prompt_ids([{"role": "user", "content": "Write a long poem about the sea."}])
        request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
        stamps: list[float] = []
        async for chunk in c.generate(request):
            if chunk.token_id is not None or chunk.finish_reason is None:
                stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps[2:], stamps[3:], strict=False)]
        return statistics.median(gaps)
    finally:
        await c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", default="1,2,3,4")
    ap.add_argument("--loops", default="uvloop,asyncio", help="event loops to compare (uvloop needs uvloop installed)")
    args = ap.parse_args()
    from exo_tui.net import loop as event_loop

    counts = [int(x) for x in args.nodes.split(",")]
    loops = args.loops.split(",")
    results: dict[tuple[str, int, bool], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        home = Path(d)
        for _ in range(args.rounds):
            for loop in loops:
                os.environ[event_loop.ENV] = loop  # node processes inherit it
                for tls in (True, False):
                    for n in counts:
                        step = event_loop.run(_measure(n, args.backend, tls, args.tokens, home))
                        results.setdefault((loop, n, tls), []).append(step)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nDecode of the default model, one stream, {args.backend} on every node, loopback, "
          f"median over {args.rounds} rounds\n")
    print("| loop | nodes | TLS | ms/token | tok/s | ÷ 1 node | per extra hop, ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for loop in loops:
        for tls in (True, False):
            one = med.get((loop, 1, tls))
            for n in counts:
                s = med[(loop, n, tls)]
                ratio = f"{one / s:.2f}" if one else "–"
                hop = f"{(s - one) / (n - 1) * 1000:.2f}" if one and n > 1 else "–"
                print(f"| {loop} | {n} | {'on' if tls else 'off'} | {s * 1000:.1f} | {1 / s:.1f} | {ratio} | {hop} |")


if __name__ == "__main__":
    main()
