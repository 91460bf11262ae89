"""Prefill and decode speed of the ONNX backend on the default model (one shard, all layers),
for each precision and thread count, measured side by side in one run.

    .venv/bin/python benchmarks/onnx_kernels.py [--threads 1 2] [--precision float32 int8] [--rows 1 2 4 8 16]

Prints best-of-``--repeats`` tokens/s (wall clock) and the process CPU time per decoded token,
which stays meaningful when other work shares the machine; then, for each ``--rows``, the median
time of one batched decode step of that many requests (each with a 64-token context): what
batching concurrent streams costs a node.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.base import Shard  # noqa: E402
from backends.onnx import ONNXBackend, physical_cores  # noqa: E402
from exo_tui.models.gguf_file import GGUFModel  # noqa: E402
from exo_tui.models.registry import resolve_model  # noqa: E402


@dataclass
class Speed:
    prefill_tok_s: float
    decode_tok_s: float
    decode_cpu_ms: float  # process CPU time per decoded token (all threads)


def measure(shard: Shard, prompt_tokens: int = 64, decode_tokens: int = 64, repeats: int = 3) -> Speed:
    """Best-of-``repeats`` prefill and greedy decode speed of a whole-model shard."""
    rng = np.random.default_rng(0)
    vocab = shard.config.vocab_size
    best = Speed(0.0, 0.0, float("inf"))
    for r in range(repeats):
        rid = f"bench-{r}"
        ids = rng.integers(0, vocab, prompt_tokens)
        t0 = time.perf_counter()
        logits = shard.forward(rid, ids, np.arange(prompt_tokens))
        t1, c1 = time.perf_counter(), time.process_time()
        token = int(logits[-1].argmax())
        for i in range(decode_tokens):
            pos = prompt_tokens + i
            token = int(shard.forward(rid, np.array([token]), np.array([pos]))[-1].argmax())
        t2, c2 = time.perf_counter(), time.process_time()
        shard.drop(rid)
        best.prefill_tok_s = max(best.prefill_tok_s, prompt_tokens / (t1 - t0))
        best.decode_tok_s = max(best.decode_tok_s, decode_tokens / (t2 - t1))
        best.decode_cpu_ms = min(best.decode_cpu_ms, (c2 - c1) / decode_tokens * 1e3)
    return best


def batched_steps(shard: Shard, rows: list[int], context: int = 64, repeats: int = 15) -> dict[int, float]:
    """Median seconds of one decode step of ``r`` requests run as one batch, for each ``r``."""
    rng = np.random.default_rng(1)
    vocab = shard.config.vocab_size
    for i in range(max(rows)):
        shard.forward(f"batch-{i}", rng.integers(0, vocab, context), np.arange(context))
    out = {}
    for r in rows:
        times = []
        for _ in range(repeats):
            items = [(f"batch-{i}", rng.integers(0, vocab, 1), np.array([context])) for i in range(r)]
            t0 = time.perf_counter()
            shard.forward_batch(items)
            times.append(time.perf_counter() - t0)
            for i in range(r):
                shard.truncate_kv(f"batch-{i}", context)
        out[r] = float(np.median(times))
    for i in range(max(rows)):
        shard.drop(f"batch-{i}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, physical_cores()}))
    ap.add_argument("--precision", nargs="+", default=["float32", "int8"])
    ap.add_argument("--spin", nargs="+", choices=["default", "0", "1"], default=["default"],
                    help="idle intra-op threads spin: the backend's bounded default, never (0) or until a step ends (1)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="batched decode steps to time")
    args = ap.parse_args()
    model = GGUFModel(resolve_model())
    config = model.config
    weights = model.shard_weights(0, config.n_layers)
    print(f"{model.name}: prompt {args.prompt} tokens, decode {args.decode} tokens, best of {args.repeats}")
    print(f"{'precision':<10}{'threads':>8}{'spin':>8}{'load s':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode cpu ms/tok':>19}")
    runs = [(p, t, spin) for p in args.precision for t in args.threads for spin in args.spin]
    for precision, threads, spin in runs:
        backend = ONNXBackend(threads=threads, precision=precision, spin=None if spin == "default" else spin == "1")
        t0 = time.perf_counter()
        shard = backend.load_shard(config, weights)
        load_s = time.perf_counter() - t0
        s = measure(shard, args.prompt, args.decode, args.repeats)
        steps = batched_steps(shard, args.rows) if args.rows else {}
        shard.close()
        print(
            f"{precision:<10}{threads:>8}{spin:>8}{load_s:>8.2f}{s.prefill_tok_s:>15.1f}"
            f"{s.decode_tok_s:>14.1f}{s.decode_cpu_ms:>19.2f}"
        )
        if steps:
            one = steps[min(steps)]
            print("    batched decode step, ms: " + " · ".join(
                f"{r} rows {t * 1e3:.1f} ({r * one / t / min(steps):.2f}x the tokens)" for r, t in steps.items()))


if __name__ == "__main__":
    main()
