"""Where an ONNX shard's decode step (or prefill) goes, per op type, from ONNX Runtime's own profiler.

Loads the whole model as one shard (``EXO_TUI_THREADS`` threads), decodes ``--decode`` tokens
after a 16-token prompt with ``SessionOptions.enable_profiling`` on, and prints per op type the
sum over its nodes of each node's median time in a decode step (medians, because on a shared
machine other work preempts a step anywhere), the slowest nodes, and the median gap between a
whole run and its nodes (ONNX Runtime's own work in a run). ``--prefill N`` times instead
prompts of N tokens (5 of them, each a new request): a prefill run's ops.

``--against MODEL`` profiles that model too and prints, per op type, what the first costs a step
beyond it (``--model bench:gemma3-2048 --against bench:llama-2048``: a family's extra ops).

    python benchmarks/onnx_profile.py [--model bench:moe] [--threads 1] [--decode 64] [--prefill 64] [--against MODEL]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402


def _profiled_shard(path: Path, threads: int, prefix: str):  # noqa: ANN202 - an ONNXShard
    """The whole model as one shard whose session profiles itself; ``(shard, vocabulary size)``."""
    import onnxruntime as ort

    from backends import configure_backend
    from exo_tui.models.gguf_file import GGUFModel

    plain = ort.SessionOptions

    def profiling() -> ort.SessionOptions:
        options = plain()
        options.enable_profiling = True
        options.profile_file_prefix = prefix
        return options

    ort.SessionOptions = profiling  # the shard's session, made below, profiles itself
    try:
        model = GGUFModel(path)
        weights = model.shard_weights(0, model.config.n_layers)
        weights.disposable = True
        shard = configure_backend("onnx", threads=threads).load_shard(model.config, weights)
    finally:
        ort.SessionOptions = plain
    return shard, model.config.vocab_size


def profiled_decode(path: Path, threads: int, n: int, prefix: str) -> tuple[str, float]:
    """Decodes ``n`` tokens with profiling on; ``(profile file, tok/s)``."""
    shard, vocab = _profiled_shard(path, threads, prefix)
    prompt = np.random.default_rng(0).integers(100, min(16000, vocab - 1), size=16)
    logits = shard.forward("p", prompt, np.arange(16))
    t0 = time.perf_counter()
    for pos in range(16, 16 + n):
        logits = shard.forward("p", np.array([int(np.argmax(logits[-1]))]), np.array([pos]))
    tok_s = n / (time.perf_counter() - t0)
    return shard._session.end_profiling(), tok_s


def profiled_prefill(path: Path, threads: int, n: int, prefix: str) -> tuple[str, float]:
    """Prefills 5 prompts of ``n`` tokens (after one to warm up) with profiling on; ``(profile
    file, the best prompt's tok/s)``."""
    shard, vocab = _profiled_shard(path, threads, prefix)
    rng = np.random.default_rng(0)
    best = 0.0
    for i in range(6):
        prompt = rng.integers(100, min(16000, vocab - 1), size=n)
        t0 = time.perf_counter()
        shard.forward(f"p{i}", prompt, np.arange(n))
        best = max(best, n / (time.perf_counter() - t0)) if i else best
        shard.drop(f"p{i}")
    return shard._session.end_profiling(), best


def summarize(profile: str, prefill: bool = False) -> dict[str, tuple[float, int]]:
    """Prints the profile's table; returns per op type (µs a step, nodes)."""
    events = json.loads(Path(profile).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    if prefill:
        runs = runs[1:]  # the first prompt warms up
    median_run = statistics.median(b - a for a, b in runs)
    steps = runs if prefill else [(a, b) for a, b in runs if b - a < 1.6 * median_run]  # the prompt's runs are longer
    starts = [a for a, _ in steps]
    times: dict[str, list[float]] = collections.defaultdict(list)
    op_of: dict[str, str] = {}
    in_run = [0.0] * len(steps)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= steps[i][1]:
            node = e["name"].removesuffix("_kernel_time")
            times[node].append(e["dur"])
            op_of[node] = e["args"].get("op_name", "?")
            in_run[i] += e["dur"]
    per_op: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for node, t in times.items():
        per_op[op_of[node]] += statistics.median(t)
        count[op_of[node]] += 1
    print(f"{len(steps)} {'prefill' if prefill else 'decode'} runs, a run's median {median_run / 1e3:.2f} ms\n")
    print(f"| op | µs a {'prompt' if prefill else 'step'} (its nodes' medians) | nodes |")
    print("|---|---:|---:|")
    for op, t in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {t:.0f} | {count[op]} |")
    print(f"| all nodes | {sum(per_op.values()):.0f} | |\n")
    for node in sorted(times, key=lambda k: -statistics.median(times[k]))[:8]:
        print(f"{node}: median {statistics.median(times[node]):.0f} µs")
    gaps = [b - a - n for (a, b), n in zip(steps, in_run, strict=True)]
    print(f"\na run less its nodes: median {statistics.median(gaps):.0f} µs")
    return {op: (t, count[op]) for op, t in per_op.items()}


def compare(name: str, ops: dict[str, tuple[float, int]], base_name: str, base: dict[str, tuple[float, int]]) -> None:
    print(f"\n{name} beyond {base_name}, per op type (µs a decode step; nodes)\n")
    print("| op | µs a step | beyond | nodes | beyond |")
    print("|---|---:|---:|---:|---:|")
    for op in sorted(set(ops) | set(base), key=lambda o: -abs(ops.get(o, (0, 0))[0] - base.get(o, (0, 0))[0])):
        (t, n), (t0, n0) = ops.get(op, (0.0, 0)), base.get(op, (0.0, 0))
        print(f"| {op} | {t:.0f} | {t - t0:+.0f} | {n} | {n - n0:+d} |")
    total, total0 = sum(t for t, _ in ops.values()), sum(t for t, _ in base.values())
    print(f"| all nodes | {total:.0f} | {total - total0:+.0f} | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench:moe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="profile prompts of this many tokens instead of decode")
    ap.add_argument("--against", default=None, help="a second model: per op type, what the first costs beyond it")
    args = parse(ap, model="bench:tiny", decode=4)
    from benchmarks.single_node import _bench_model
    from exo_tui.models.catalog import resolve_model

    folder = Path(tempfile.mkdtemp(prefix="exo-onnx-profile-"))  # every session's profile, kept
    results = []
    what = f"prefill of {args.prefill} tokens" if args.prefill else "decode"
    for i, name in enumerate([args.model] + ([args.against] if args.against else [])):
        path = _bench_model(name[len("bench:"):]) if name.startswith("bench:") else resolve_model(name)
        if args.prefill:
            profile, tok_s = profiled_prefill(path, args.threads, args.prefill, str(folder / f"ort{i}"))
        else:
            profile, tok_s = profiled_decode(path, args.threads, args.decode, str(folder / f"ort{i}"))
        if i:
            print()
        print(f"{path.name}, {args.threads} threads: {what} {tok_s:.1f} tok/s with the profiler on "
              f"(profile: {profile})\n")
        results.append((path.name, summarize(profile, prefill=bool(args.prefill))))
    if args.against:
        compare(*results[0], *results[1])


if __name__ == "__main__":
    main()
