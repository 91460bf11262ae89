"""What a step on one ONNX shard takes in memory beyond its KV caches: each step's peak resident
memory above what the process held before it (Linux's VmHWM, reset before each step through
/proc/self/clear_refs), what stays held after it (ONNX Runtime's arena keeps what it grew by), and
the bytes of cache the step wrote. So the node's KV reserve (``exo_tui/node/kv_budget.py``) can be
checked against a prefill's chunk (``backends/base.py`` PREFILL_CHUNK) and against a growth
of the cache pool (its caches copied into larger arrays).

    .venv/bin/python benchmarks/step_memory.py [--model PATH | --big-model-shape --layers 15]
        [--steps a:0:512,b:0:512,a:512:255,a:767:1] [--chunk 512] [--mem-pattern]

A step is ``request:cached:rows``: a request holding ``cached`` positions (steps of up to a chunk
run first to reach them, unmeasured) computes ``rows`` more. ``--big-model-shape``: a random model
of tests/integration/test_big_model.py's shape (hidden 2048, Q4_K), a middle shard of
``--layers``; else the whole of ``--model`` (the default model's file by default).
``--mem-pattern``: ONNX Runtime's memory patterns on, as they were before the shard turned them
off (a second run of a shape allocates its pattern's block as one, beside what the first run left
in the arena).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402

MB = 1e6


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: the default model's)")
    ap.add_argument("--big-model-shape", action="store_true")
    ap.add_argument("--layers", type=int, default=15, help="with --big-model-shape: the shard's layers")
    ap.add_argument("--steps", default="a:0:1,a:1:1,b:0:512,c:0:512,d:0:512,d:512:255,d:767:1")
    ap.add_argument("--chunk", type=int, default=0, help="the shard's prefill chunk (default: the backend's)")
    ap.add_argument("--mem-pattern", action="store_true", help="ONNX Runtime's memory patterns on (the shard has them off)")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, steps="a:0:1,a:1:1,b:0:64")

    import onnxruntime as ort

    if args.mem_pattern:  # the shard turns them off: turn them back on
        base = ort.SessionOptions

        class Options(base):  # type: ignore[misc, valid-type]
            @property
            def enable_mem_pattern(self) -> bool:
                return True

            @enable_mem_pattern.setter
            def enable_mem_pattern(self, value: bool) -> None:
                base.enable_mem_pattern.__set__(self, True)

        ort.SessionOptions = Options

    from backends.onnx import ONNXBackend
    from exo_tui.models.catalog import resolve_model
    from exo_tui.models.gguf_file import GGUFModel

    with tempfile.TemporaryDirectory() as tmp:  # the random model's file goes once its shard is loaded
        if args.big_model_shape:
            from tests.integration.test_big_model import write_model

            model = GGUFModel(write_model(Path(tmp) / "big.gguf", args.layers + 2))
            start, end = 1, 1 + args.layers
        else:
            model = GGUFModel(args.model or resolve_model())
            start, end = 0, model.config.n_layers
        cfg = model.config
        shard = ONNXBackend(threads=args.threads).load_shard(cfg, model.shard_weights(start, end))
        del model
    if args.chunk:
        shard.prefill_chunk = args.chunk
    kv_position = (end - start) * 2 * cfg.n_kv_heads * cfg.head_dim * shard.kv_dtype.itemsize
    rng = np.random.default_rng(0)

    def rows(n: int) -> np.ndarray:
        if shard.is_first:
            return rng.integers(0, cfg.vocab_size, n).astype(np.int64)
        return rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)

    gc.collect()
    print(f"layers [{start}, {end}) of {cfg.n_layers}: hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"{cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, context {cfg.context_length}; {shard.kv_dtype} caches, "
          f"prefill chunk {shard.prefill_chunk}, memory patterns {'on' if args.mem_pattern else 'off'}; "
          f"resident {_status('VmRSS') / MB:.1f} MB loaded")
    print(f"{'step':>14} {'pool':>5} {'KV written MB':>14} {'KV held MB':>11} {'peak above MB':>14} "
          f"{'kept MB':>8} {'ms':>7}")
    for spec in args.steps.split(","):
        rid, cached, n = spec.split(":")
        have = shard.kv_length(rid)
        for a in range(have, int(cached), shard.prefill_chunk):
            b = min(a + shard.prefill_chunk, int(cached))
            shard.forward(rid, rows(b - a), np.arange(a, b))
        held = sum(shard.kv_length(r) for r in shard.requests()) * kv_position
        x, positions = rows(int(n)), np.arange(int(cached), int(cached) + int(n))
        gc.collect()
        before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        shard.forward(rid, x, positions)
        ms = (time.perf_counter() - t0) * 1e3
        peak, after = _status("VmHWM"), _status("VmRSS")
        print(f"{spec:>14} {shard.kv.caches[rid].capacity:>5} {int(n) * kv_position / MB:>14.1f} {held / MB:>11.1f} "
              f"{(peak - before) / MB:>14.1f} {(after - before) / MB:>8.1f} {ms:>7.0f}")
    shard.close()


if __name__ == "__main__":
    main()
