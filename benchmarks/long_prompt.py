"""Time to the first token of a long prompt through N node processes on loopback: its chunks
pipelined through the ring (the coordinator's default: as many in flight as the nodes can run at
once, ``PlanSwitching.fill_window``) against one chunk at a time, side by side on the same cluster,
alternated.

    python benchmarks/long_prompt.py [--nodes 3] [--threads 1] [--prompt 2000] [--rounds 4]

``--threads``: each node's intra-op threads (``EXO_TUI_THREADS``). Nodes on one machine run at
once only as far as its cores hold their threads: with 3 nodes of 2 threads on 2 cores the window
is 1 and both rows measure the same thing. On separate machines every node runs beside the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402


async def _ttft(c, tokens: list[int]) -> float:  # noqa: ANN001
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    t0 = time.perf_counter()
    async for chunk in c.generate(Request(tokens, SamplingParams(temperature=0.0, seed=1), 1)):
        if chunk.token_id is not None:
            return time.perf_counter() - t0
    raise RuntimeError("no token came")


async def run(args: argparse.Namespace, home: Path) -> None:
    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.config import Config
    from exo_tui.models.catalog import resolve_model

    c = Coordinator(model=str(resolve_model(None)), local_nodes=args.nodes, local_backends=["onnx"], config=Config(),
                    home=home, persist=False, strategy="even")
    await c.start()
    try:
        host = c.pipeline.host
        window = host.fill_window
        plan = await host.plan_ready()
        host.step_done()
        print(f"{args.nodes} nodes, {args.threads} thread(s) each, prompt {args.prompt} tokens in chunks of "
              f"{host.prefill_rows(plan)}; pipelined: {window(plan)} chunk(s) in flight")
        times: dict[str, list[float]] = {"pipelined": [], "one chunk at a time": []}
        for r in range(args.rounds):
            tokens = [int(t) for t in np.random.default_rng(r).integers(300, 5000, args.prompt)]
            for name in times:
                host.fill_window = window if name == "pipelined" else (lambda _plan: 1)
                times[name].append(await _ttft(c, tokens))
        host.fill_window = window
        base = statistics.median(times["one chunk at a time"])
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts):.3f} s | {base / statistics.median(ts):.2f}x | "
                  + ", ".join(f"{t:.2f}" for t in ts) + " |")
    finally:
        await c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    args = parse(ap, nodes=2, prompt=600, rounds=1)
    os.environ["EXO_TUI_THREADS"] = str(args.threads)  # the node processes take it
    from exo_tui.net import loop as event_loop

    with tempfile.TemporaryDirectory() as d:
        event_loop.run(run(args, Path(d)))


if __name__ == "__main__":
    main()
