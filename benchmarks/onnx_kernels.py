"""Prefill and decode speed of the ONNX backend on the default model (one shard, all layers).

    .venv/bin/python benchmarks/onnx_kernels.py [--threads N] [--precision float32|int8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.onnx import ONNXBackend
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.registry import resolve_model


def measure(shard, prompt_tokens: int, decode_tokens: int, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` prefill and decode tokens/s."""
    rng = np.random.default_rng(0)
    vocab = shard.config.vocab_size
    best_prefill = best_decode = 0.0
    for r in range(repeats):
        rid = f"bench-{r}"
        ids = rng.integers(0, vocab, prompt_tokens)
        t0 = time.perf_counter()
        logits = shard.forward(rid, ids, np.arange(prompt_tokens))
        t1 = time.perf_counter()
        token = int(logits[-1].argmax())
        for i in range(decode_tokens):
            pos = prompt_tokens + i
            token = int(shard.forward(rid, np.array([token]), np.array([pos]))[-1].argmax())
        t2 = time.perf_counter()
        shard.drop(rid)
        best_prefill = max(best_prefill, prompt_tokens / (t1 - t0))
        best_decode = max(best_decode, decode_tokens / (t2 - t1))
    return best_prefill, best_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = GGUFModel(resolve_model())
    config = model.config
    weights = model.shard_weights(0, config.n_layers)
    backend = ONNXBackend(threads=args.threads, precision=args.precision)
    t0 = time.perf_counter()
    shard = backend.load_shard(config, weights)
    load_s = time.perf_counter() - t0
    prefill, decode = measure(shard, args.prompt, args.decode, args.repeats)
    print(f"{'model':<28}{'threads':>8}{'precision':>10}{'load s':>8}{'prefill tok/s':>15}{'decode tok/s':>14}")
    print(f"{model.name:<28}{backend.threads:>8}{backend.precision:>10}{load_s:>8.2f}{prefill:>15.1f}{decode:>14.1f}")


if __name__ == "__main__":
    main()
