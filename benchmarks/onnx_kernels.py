"""Prefill and decode speed of the ONNX backend on the default model (one shard, all layers),
for each precision and thread count, measured side by side in one run.

    .venv/bin/python benchmarks/onnx_kernels.py [--threads 1 2] [--precision float32 int8] [--rows 1 2 4 8 16]

Prints best-of-``--repeats`` tokens/s (wall clock) and the process CPU time per decoded token,
which stays meaningful when other work shares the machine; then, for each ``--rows``, the median
time of one batched decode step of that many requests (each with a 64-token context): what
batching concurrent streams costs a node.

    .venv/bin/python benchmarks/onnx_kernels.py --matmul 4096x4096 [--threads 1 2] [--matmul-rows 64] [--formats Q4_0 Q5_0]

times instead one matrix of that shape (N x K) per decode step (one row), in each block format
the kernel runs (``--formats``: by default Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K; Q4_0 and Q5_1
too), on ``QLinear`` at each precision and on ``MatMulNBits`` (what runs without the kernel),
with the bytes each reads per step (the matrix's own arrays; MatMulNBits' correction also
multiplies a block-indicator matrix shared by all layers, not counted) against the file's.
``--matmul-rows 64`` times runs of 64 rows instead (a prompt's product) and adds each
precision's GFLOP/s.
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
from benchmarks.quick import parse  # noqa: E402
from exo_tui.models.catalog import resolve_model  # noqa: E402
from exo_tui.models.gguf_file import GGUFModel  # noqa: E402


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


FORMATS = ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def random_matrix(rng: np.random.Generator, n: int, k: int, fmt: str):
    """A random ``n x k`` matrix in GGUF block format ``fmt``, as the reader gives it."""
    from backends.onnx import kernels

    return (kernels.random_kquant if fmt in kernels.KQUANT else kernels.random_legacy)(rng, n, k, fmt)


def file_bytes(fmt: str, weights: int) -> int:
    """The bytes ``weights`` weights of GGUF block format ``fmt`` take in a file (Q5_0's 22 a block
    of 32 against Q5_1's 24: no bias of its own, where a matrix in memory holds one)."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    return weights // block * type_size


def matmul_session(w, threads: int, kernel: bool, xbits: int = 0):
    """A one-matrix ONNX Runtime session ``y = x @ w.T`` as a shard's graph builds it (QLinear, or
    MatMulNBits with its correction), and the bytes of the matrix's own arrays."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from backends.base import ModelConfig
    from backends.onnx import kernels
    from backends.onnx.graph import _Builder

    config = ModelConfig(n_layers=1, hidden_size=w.shape[1], intermediate_size=w.shape[1], n_heads=1, n_kv_heads=1,
                         head_dim=64, vocab_size=8, rms_eps=1e-5, rope_theta=1e4, context_length=64)
    b = _Builder(config, 1, kernel=kernel, xbits=xbits)
    y = b.linear("x", [w], "y")
    n, k = w.shape
    graph = helper.make_graph(
        b.nodes, "matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(a, name) for name, a in b.arrays.items()] + b.small,
    )
    domains = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=domains + ([helper.make_opsetid(kernels.DOMAIN, 1)] if kernel else []))
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if kernel:
        options.register_custom_ops_library(kernels.library().path)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    used = {n.op_type for n in b.nodes}
    own = sum(a.nbytes for name, a in b.arrays.items() if not name.startswith("block_ones"))
    return session, own, used


def step_ms(session, k: int, repeats: int = 200, rows: int = 1) -> float:
    """Process CPU milliseconds per run on ``rows`` rows (all threads; steadier than the wall clock
    where other work shares the machine: with one thread it is that thread's time), the
    least of 5 rounds of ``repeats // 5``."""
    x = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
    for _ in range(max(2, 20 // rows)):
        session.run(None, {"x": x})
    rounds = []
    for _ in range(5):
        c0 = time.process_time()
        for _ in range(repeats // 5):
            session.run(None, {"x": x})
        rounds.append((time.process_time() - c0) / (repeats // 5))
    return min(rounds) * 1e3


def matmul_table(shapes: list[str], threads: list[int], formats: tuple[str, ...] = FORMATS, rows: int = 1) -> None:
    """For each shape and thread count, a row per block format: bits read per weight (file,
    QLinear, MatMulNBits) and ms per decode step (or run of ``rows`` rows, then QLinear's GFLOP/s
    too), with the ratios against Q4_1 on QLinear and against MatMulNBits for the same matrix."""
    from backends.onnx import kernels

    lib = kernels.library()
    if lib is None:
        raise SystemExit(f"no QLinear kernel here: {kernels.unavailable()}")
    xbits_list = (0, 16, 8) if lib.integer else (0,)
    names = {0: "float32", 16: "int16", 8: "int8"}
    rng = np.random.default_rng(0)
    repeats = max(25, 200 // rows)
    what = "one row a step, CPU ms per step" if rows == 1 else f"{rows} rows a run, CPU ms per run"
    print(f"QLinear build {lib.build} ({lib.isa}); {what} (least of 5 rounds of {repeats // 5})")
    for shape in shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        weights = {f: random_matrix(rng, n, k, f) for f in formats}
        for t in threads:
            print(f"\n{n} x {k}, {t} thread(s)")
            head = f"{'format':<7}{'file b/w':>9}{'QLinear b/w':>12}{'MatMulNBits b/w':>16}"
            head += "".join(f"{'QL ' + names[x] + ' ms':>16}" for x in xbits_list)
            head += f"{'MatMulNBits ms':>15}{'float32 vs Q4_1':>17}{'float32 vs MNB':>16}"
            print(head + ("".join(f"{'QL ' + names[x] + ' GFLOP/s':>21}" for x in xbits_list) if rows > 1 else ""))
            base = None
            for f, w in weights.items():
                per = 8 / (n * k)
                ql = {}
                for x in xbits_list:
                    session, ql_bytes, used = matmul_session(w, t, True, x)
                    assert used == {kernels.OP}, used
                    ql[x] = step_ms(session, k, repeats, rows)
                mnb_session, mnb_bytes, used = matmul_session(w, t, False)
                assert "MatMulNBits" in used, used
                mnb = step_ms(mnb_session, k, repeats, rows)
                base = ql[0] if f == "Q4_1" else base
                row = f"{f:<7}{file_bytes(f, n * k) * per:>9.3f}{ql_bytes * per:>12.3f}{mnb_bytes * per:>16.3f}"
                row += "".join(f"{ql[x]:>16.3f}" for x in xbits_list)
                ratio = f"{ql[0] / base:>17.2f}" if base else f"{'':>17}"
                gflops = "".join(f"{2 * rows * n * k / (ql[x] * 1e6):>21.1f}" for x in xbits_list) if rows > 1 else ""
                print(row + f"{mnb:>15.3f}" + ratio + f"{ql[0] / mnb:>16.2f}" + gflops)


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
    ap.add_argument("--matmul", nargs="*", default=[], metavar="NxK",
                    help="time one N x K matrix per decode step in each block format instead of the model")
    ap.add_argument("--matmul-rows", type=int, default=1, metavar="M",
                    help="--matmul: runs of M rows (a prompt's product) instead of one, with GFLOP/s")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS),
                    choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
                    help="--matmul: the block formats to time")
    args = parse(ap, threads=[1], precision=["int8"], prompt=8, decode=4, repeats=1, rows=[1, 2])
    if args.matmul:
        matmul_table(args.matmul, args.threads, tuple(args.formats), rows=args.matmul_rows)
        return
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
