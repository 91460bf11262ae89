"""Decode and prefill speed of several checkouts of exo-tui side by side, against llama.cpp.

Each checkout (a git worktree, e.g. ``git worktree add /tmp/base COMMIT``) runs in its own worker
process with that tree first on the path and one ONNX shard of the whole model loaded (the tree's
own backend, kernels and graph); a llama.cpp worker runs beside them. The driver asks the workers
in turn for one prefill and one decode, many rounds, alternating the order, so a loaded machine's
drift lands on every engine alike; only the workers measure. Per engine it reports the medians of
tok/s by wall time and by the worker's CPU time (on one thread the less load-dependent figure), the
fastest tenth of decode steps (what an engine does while it has the cores: on a shared machine
llama.cpp's decode falls far more than exo-tui's when other work takes the cores, so a plain
median ratio to llama.cpp says as much about the load as about the code), and each figure's ratio
to the first tree as the median of the rounds' ratios.

    python benchmarks/ab_trees.py TREE [TREE ...] [--model PATH] [--threads 2] [--rounds 9]
        [--prompt 64] [--decode 64] [--no-llama]

A tree is a path or ``NAME=PATH``. Give one tree twice under two names to see how far two
identical engines part on this machine at this moment: the noise floor of the other ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
from pathlib import Path
kind, model, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
if kind == "llama.cpp":
    from llama_cpp import Llama, llama_get_logits_ith  # Llama.scores stays unwritten without logits_all
    llm = Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
    def start(tokens):
        llm.reset(); llm.eval(tokens); return None
    def step(state):
        last = np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        llm.eval([int(np.argmax(last))]); return None
    def drop(state): pass
else:
    from backends import get_backend
    from exo_tui.models.gguf_file import GGUFModel
    m = GGUFModel(Path(model))
    shard = get_backend("onnx").load_shard(m.config, m.shard_weights(0, m.config.n_layers))
    count = [0]
    def start(tokens):
        count[0] += 1; rid = f"r{count[0]}"
        return [rid, shard.forward(rid, np.asarray(tokens), np.arange(len(tokens))), len(tokens)]
    def step(state):
        rid, logits, pos = state
        state[1] = shard.forward(rid, np.array([int(np.argmax(logits[-1]))]), np.array([pos])); state[2] += 1
    def drop(state): shard.drop(state[0])
def measure(tokens, n):
    t0, c0 = time.perf_counter(), time.process_time()
    state = start(tokens)
    t1, c1 = time.perf_counter(), time.process_time()
    steps = []
    for _ in range(n):
        s0 = time.perf_counter()
        step(state)
        steps.append(time.perf_counter() - s0)
    t2, c2 = time.perf_counter(), time.process_time()
    if state is not None:
        drop(state)
    return len(tokens) / (t1 - t0), len(tokens) / (c1 - c0), n / (t2 - t1), n / (c2 - c1), steps
measure(prompt, 4)
print("ready", flush=True)
for line in sys.stdin:
    what, n = line.split()
    print(json.dumps(measure(prompt, 0)[:2] if what == "prefill" else measure(prompt[:16], int(n))[2:]), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", help="(with --quick, none: this checkout)")
    ap.add_argument("--model", default=None, help="a GGUF path, a registered name, or bench:SHAPE (benchmarks/big_model.py)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--no-llama", action="store_true", help="no llama.cpp worker")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.quick import have_llama_cpp, parse

    args = parse(ap, rounds=1, prompt=8, decode=4, model="bench:tiny")
    if not args.trees:
        if not args.quick:
            ap.error("name at least one tree")
        args.trees = [str(Path(__file__).resolve().parents[1])]
    if not args.no_llama and not have_llama_cpp():
        args.no_llama = True
    import numpy as np

    from benchmarks.single_node import _model_path
    from exo_tui.models.gguf_file import GGUFModel

    path = _model_path(args.model)
    vocab = GGUFModel(path).config.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(min(100, vocab // 4), min(40000, vocab - 16), size=args.prompt)]
    named = [t.split("=", 1) if "=" in t else (Path(t).name, t) for t in args.trees]
    env = dict(os.environ, EXO_TUI_THREADS=str(args.threads))
    workers: dict[str, subprocess.Popen] = {}
    try:
        for name, tree in named:
            workers[name] = subprocess.Popen(
                [sys.executable, "-c", WORKER, "onnx", str(path), str(args.threads), json.dumps(prompt)],
                cwd=tree, env=dict(env, PYTHONPATH=str(Path(tree).resolve())), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )
            _ready(workers[name], name)
        if not args.no_llama:
            workers["llama.cpp"] = subprocess.Popen(
                [sys.executable, "-c", WORKER, "llama.cpp", str(path), str(args.threads), json.dumps(prompt)],
                cwd=named[0][1], env=dict(env, PYTHONPATH=str(Path(named[0][1]).resolve())), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )
            _ready(workers["llama.cpp"], "llama.cpp")
        kinds = ("prefill", "prefill cpu", "decode", "decode cpu", "decode p10")
        results = {name: {k: [] for k in kinds} for name in workers}
        for r in range(args.rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))  # no engine always first
            for name in order:
                for what in ("prefill", "decode"):
                    w = workers[name]
                    w.stdin.write(f"{what} {args.decode}\n")
                    w.stdin.flush()
                    wall, cpu, *steps = json.loads(w.stdout.readline())
                    results[name][what].append(wall)
                    results[name][f"{what} cpu"].append(cpu)
                    if steps:  # the round's fastest tenth of steps: what the engine does when it has the cores
                        results[name]["decode p10"].append(1 / float(np.percentile(steps[0], 10)))
            print(f"round {r + 1}: " + "  ".join(f"{n} {results[n]['decode'][-1]:.0f}" for n in workers), file=sys.stderr)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait(timeout=60)

    first = named[0][0]
    print(f"\n{path.name}, {args.threads} threads, prompt {args.prompt}, decode {args.decode}, "
          f"{args.rounds} interleaved rounds; tok/s by wall time and by the worker's CPU time; ratios are "
          f"medians of each round's ratio\n")
    ref = results.get("llama.cpp")
    print("| engine | " + " | ".join(f"{k} tok/s" for k in kinds) + " | "
          + " | ".join(f"{k} ÷ {first}" for k in kinds) + (" | prefill ÷ llama.cpp | decode p10 ÷ llama.cpp |" if ref else " |"))
    print("|---|" + "---:|" * (2 * len(kinds) + (2 if ref else 0)))
    for name, r in results.items():
        cells = [f"{statistics.median(r[k]):.1f}" for k in kinds]
        cells += [f"{_ratio(r[k], results[first][k]):.3f}" for k in kinds]
        if ref:
            cells += [f"{_ratio(r[k], ref[k]):.2f}" for k in ("prefill", "decode p10")]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _ready(w: subprocess.Popen, name: str) -> None:
    line = w.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"the worker for {name} did not start (exit {w.poll()}): see its output above")


if __name__ == "__main__":
    main()
