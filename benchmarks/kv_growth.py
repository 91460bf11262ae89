"""One stream decoding a long answer on one ONNX shard of the default model (``--model``): the step time at
each growth of the KV pool it is in (256, 768, 1792, ... positions: its cache copied into larger
arrays, see ``backends/onnx/kv_pool.py``) against the median step around it, so a stall in a long
answer shows.

    .venv/bin/python benchmarks/kv_growth.py [--positions 4200] [--precision int16] [--model NAME]

Prints one row per growth: the position, the new capacity, that step's time and the median of the
32 steps before it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.onnx import ONNXBackend  # noqa: E402
from benchmarks.quick import parse  # noqa: E402
from benchmarks.single_node import _model_path  # noqa: E402
from exo_tui.models.gguf_file import GGUFModel  # noqa: E402


def capacity_of(shard) -> int:
    """The positions the stream's pool holds (the shard's own bookkeeping)."""
    return shard.kv.caches["r"].capacity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=4200)
    ap.add_argument("--precision", default="int16", choices=["int16", "float32", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a GGUF path, a registered name, or bench:SHAPE (default: the default model)")
    args = parse(ap, positions=260, model="bench:tiny")
    model = GGUFModel(_model_path(args.model))
    cfg = model.config
    shard = ONNXBackend(threads=args.threads, precision=args.precision).load_shard(cfg, model.shard_weights(0, cfg.n_layers))
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 32)
    token = int(shard.forward("r", prompt, np.arange(len(prompt)))[-1].argmax())
    capacity, recent = capacity_of(shard), []
    print(f"{model.name}, {args.precision} ({shard.kv_dtype} caches), {args.threads} threads")
    print(f"{'position':>9} {'capacity':>9} {'growth step ms':>15} {'median step ms':>15}")
    for pos in range(len(prompt), min(args.positions, cfg.context_length - 1)):
        t0 = time.perf_counter()
        token = int(shard.forward("r", np.array([token]), np.array([pos]))[-1].argmax())
        dt = time.perf_counter() - t0
        if capacity_of(shard) != capacity:
            capacity = capacity_of(shard)
            print(f"{pos:>9} {capacity:>9} {dt * 1e3:>15.1f} {statistics.median(recent) * 1e3:>15.2f}")
        recent = (recent + [dt])[-32:]
    shard.close()


if __name__ == "__main__":
    main()
