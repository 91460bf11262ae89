"""Decode step time of the ONNX backend under each spin policy, alone and beside busy processes.

Between the ops of a step, ONNX Runtime's idle intra-op threads either sleep at once, spin for a
bounded time, or spin until the step returns (``backends.onnx.SPIN_US``). Spinning saves the
wake-up of a sleeping thread at each op; where another process wants the core, a spinning thread
keeps it from the step's other thread. This measures both sides: one whole-model shard of the
default model per policy, all loaded at once and taking turns (the machine drifts over minutes),
first alone, then beside 1, 2, ... processes that each keep a core busy. The last column is the
CPU time the process spends in the 200 ms after a step returns (median of 3): spinning is between
a step's ops only, so it stays near zero under every policy.

    .venv/bin/python benchmarks/onnx_spin.py [--spin 0,15,25,40,until-end] [--busy 0,1,2]
                                             [--pin off|on|off,on] [--rounds 10] [--tokens 24]
                                             [--threads 2]

``--pin off,on`` measures every policy with and without core pinning (``EXO_TUI_ONNX_PIN``, see
``backends/onnx/affinity.py``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.base import Shard  # noqa: E402
from backends.onnx import ONNXBackend, physical_cores  # noqa: E402
from benchmarks.quick import parse  # noqa: E402
from exo_tui.models.catalog import resolve_model  # noqa: E402
from exo_tui.models.gguf_file import GGUFModel  # noqa: E402


def _policy(name: str) -> bool | int:
    return True if name == "until-end" else int(name)


def _label(name: str) -> str:
    return {"0": "never", "until-end": "until the step ends"}.get(name, f"{name} µs")


def decode_steps(shard: Shard, tokens: int) -> list[float]:
    """Seconds of each greedy decode step after a 16-token prompt."""
    vocab = shard.config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, 16)
    token = int(shard.forward("bench", ids, np.arange(16))[-1].argmax())
    steps = []
    for i in range(tokens):
        t0 = time.perf_counter()
        token = int(shard.forward("bench", np.array([token]), np.array([16 + i]))[-1].argmax())
        steps.append(time.perf_counter() - t0)
    shard.drop("bench")
    return steps


def idle_cpu_ms(shard: Shard, idle_s: float = 0.2) -> float:
    """CPU time (ms) this process spends in the ``idle_s`` after a step returns: spinning is
    between a step's ops only, so this stays near zero under every policy."""
    shard.forward("idle", np.arange(1, 17), np.arange(16))
    cpu = time.process_time()  # right as the step returns
    time.sleep(idle_s)
    used = time.process_time() - cpu
    shard.drop("idle")
    return used * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spin", default="0,15,25,40,until-end", help="policies: microseconds, or until-end")
    ap.add_argument("--busy", default="0,1,2", help="how many busy processes beside the steps, each a run")
    ap.add_argument("--pin", default="off", help="core pinning: off, on or off,on")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=physical_cores())
    args = parse(ap, spin="0,until-end", busy="0", rounds=1, tokens=4)

    model = GGUFModel(resolve_model())
    weights = model.shard_weights(0, model.config.n_layers)
    pins = args.pin.split(",")
    if not set(pins) <= {"off", "on"}:
        ap.error("--pin takes off, on or off,on")
    names = [(n, pin) for pin in pins for n in args.spin.split(",")]
    shards = {
        (n, pin): ONNXBackend(threads=args.threads, spin=_policy(n), pin=pin == "on").load_shard(model.config, weights)
        for n, pin in names
    }
    busy_counts = [int(b) for b in args.busy.split(",")]
    medians: dict[tuple[tuple[str, str], int], float] = {}
    for busy in busy_counts:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            steps: dict[tuple[str, str], list[float]] = {n: [] for n in names}
            for _ in range(args.rounds):
                for n, shard in shards.items():
                    steps[n] += decode_steps(shard, args.tokens)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        for n in names:
            medians[(n, busy)] = statistics.median(steps[n])
    idle = {n: statistics.median(idle_cpu_ms(shard) for _ in range(3)) for n, shard in shards.items()}

    print(f"\nDecode step of the default model, one ONNX shard, {args.threads} threads, median ms of "
          f"{args.rounds} rounds x {args.tokens} steps, the policies taking turns\n")
    print("| idle threads spin | pinned | " + " | ".join(f"beside {b} busy, ms" for b in busy_counts)
          + " | CPU ms in the 200 ms after a step |")
    print("|---|---|" + "---:|" * (len(busy_counts) + 1))
    for n in names:
        cells = " | ".join(f"{medians[(n, b)] * 1000:.1f}" for b in busy_counts)
        print(f"| {_label(n[0])} | {n[1]} | {cells} | {idle[n]:.1f} |")


if __name__ == "__main__":
    main()
