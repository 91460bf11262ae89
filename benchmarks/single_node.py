"""Prefill and decode speed of each backend on the default model, against llama.cpp on the same
GGUF with the same thread count when ``llama-cpp-python`` is installed (``make bench`` builds it).

Runs alternate between engines and report medians of many repetitions, because these machines
are noisy (the same llama.cpp run varies by ±20 % between runs). Prints a table of tok/s and of
ratios to llama.cpp.

    python benchmarks/single_node.py [--threads 2] [--reps 7] [--prompt 64] [--decode 64] [--model PATH]

``--model`` (a path or a registered name) measures another file, e.g. a family fixture from
tests/fixtures/families/, with only each backend's default engine beside llama.cpp; ``bench:SHAPE``
names a random-weight file of one of ``benchmarks/big_model.py``'s shapes, written once into the
cache folder (``bench:moe``: a qwen3moe of Qwen3-30B-A3B's width, 128 experts, top 8, 4 layers).
For a mixture of experts it also prints the bytes a decoded token reads (its chosen experts',
not all of them) and the GB/s each engine's decode makes of them, next to a NumPy copy's.

Several models, comma-separated (``bench:families``: the family shapes ``llama-2048``,
``qwen2-2048``, ``qwen3-2048``, ``gemma3-2048``, ``phi3-2048``), run side by side: each in
exo-tui's ONNX engine and in llama.cpp, all alternated in each repetition, with each one's ratios
to llama.cpp and the time a token each engine spends on it beyond the first model (at one width,
a family's extra ops):

    python benchmarks/single_node.py --model bench:families --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402


def _clock() -> Callable[[int], tuple[float, float]]:
    """Started now: ``rate(n)``, n tokens' tok/s by wall time and by this process's CPU time (all
    its threads: at one thread the time the engine ran, whatever else ran on the machine)."""
    wall, cpu = time.perf_counter(), time.process_time()
    return lambda n: (n / (time.perf_counter() - wall), n / max(time.process_time() - cpu, 1e-9))


def _ours(
    backend: str, model_path: Path, threads: int, spin: bool | int | None = None, pin: bool = False,
    kernel: bool = True, precision: str | None = None,
) -> tuple[Callable[[list[int]], float], Callable[[list[int], int], float]]:
    from backends import configure_backend
    from backends.onnx import ONNXBackend, kernels

    kernels.use(kernel)  # followed by the shards made from now on
    from exo_tui.models.gguf_file import GGUFModel

    model = GGUFModel(model_path)
    custom = spin is not None or pin or precision is not None
    engine = ONNXBackend(threads=threads, spin=spin, pin=pin, precision=precision) if custom else configure_backend(backend, threads=threads)
    weights = model.shard_weights(0, model.config.n_layers)
    weights.disposable = True  # as a node loads: each layer goes once the backend has its own form of it
    shard = engine.load_shard(model.config, weights)
    del weights
    counter = [0]

    def prefill(tokens: list[int]) -> tuple[float, float]:
        counter[0] += 1
        rid = f"p{counter[0]}"
        rate = _clock()
        shard.forward(rid, np.asarray(tokens), np.arange(len(tokens)))
        tok_s = rate(len(tokens))
        shard.drop(rid)
        return tok_s

    def decode(tokens: list[int], n: int) -> tuple[float, float]:
        counter[0] += 1
        rid = f"d{counter[0]}"
        logits = shard.forward(rid, np.asarray(tokens), np.arange(len(tokens)))
        pos = len(tokens)
        rate = _clock()
        for _ in range(n):
            nxt = int(np.argmax(logits[-1]))
            logits = shard.forward(rid, np.array([nxt]), np.array([pos]))
            pos += 1
        tok_s = rate(n)
        shard.drop(rid)
        return tok_s

    return prefill, decode


def llama_last_logits(llm) -> np.ndarray:  # noqa: ANN001
    """The logits of the last token llama.cpp evaluated (llama-cpp-python 0.3.36 fills
    ``Llama.scores`` only with ``logits_all``; without it they are never written)."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def _llama_cpp(model_path: Path, threads: int) -> tuple[Callable[[list[int]], float], Callable[[list[int], int], float]] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)

    def prefill(tokens: list[int]) -> tuple[float, float]:
        llm.reset()
        rate = _clock()
        llm.eval(tokens)
        return rate(len(tokens))

    def decode(tokens: list[int], n: int) -> tuple[float, float]:
        llm.reset()
        llm.eval(tokens)
        rate = _clock()
        for _ in range(n):
            nxt = int(np.argmax(llama_last_logits(llm)))
            llm.eval([nxt])
        return rate(n)

    return prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--backends", default="onnx,mlx")
    ap.add_argument("--model", default=None,
                    help="a GGUF path or registered name (default: the default model); several, comma-separated, "
                         "are measured side by side against the first; bench:families is every family shape")
    ap.add_argument("--raw", type=Path, default=None, help="with several models: each repetition's tok/s, as JSON, here")
    args = parse(ap, reps=1, prompt=8, decode=4, backends="onnx", model="bench:tiny")

    from backends import available_backends
    from exo_tui.models.gguf_file import GGUFModel

    paths = [_model_path(name) for name in _model_names(args.model)]
    path = paths[0]
    vocab = min(GGUFModel(p).config.vocab_size for p in paths)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(min(100, vocab // 4), min(40000, vocab - 16), size=args.prompt)]
    if len(paths) > 1:
        _side_by_side(paths, args, prompt)
        return
    engines: dict[str, tuple[Callable, Callable]] = {}
    for b in args.backends.split(","):
        if b in available_backends():
            engines[f"exo-tui {b}"] = _ours(b, path, args.threads)
        if b == "onnx" and b in available_backends() and args.model is None:  # the other spin policies (backends.onnx.SPIN_US)
            engines["exo-tui onnx, never spinning"] = _ours(b, path, args.threads, spin=False)  # EXO_TUI_ONNX_SPIN=0
            engines["exo-tui onnx, spinning until each step ends"] = _ours(b, path, args.threads, spin=True)  # =1
            engines["exo-tui onnx, pinned"] = _ours(b, path, args.threads, pin=True)  # EXO_TUI_ONNX_PIN=1
            # 4-bit matrices on MatMulNBits with a correction (before QLinear; where it cannot be built)
            engines["exo-tui onnx, MatMulNBits only"] = _ours(b, path, args.threads, kernel=False)
            # float32 math on the dequantized weights (EXO_TUI_ONNX_PRECISION=float32; the default is int16)
            engines["exo-tui onnx, float32 precision"] = _ours(b, path, args.threads, precision="float32")
            # int8 activations, as llama.cpp multiplies (EXO_TUI_ONNX_PRECISION=int8)
            engines["exo-tui onnx, int8 precision"] = _ours(b, path, args.threads, precision="int8")
    ref = _llama_cpp(path, args.threads)
    if ref is not None:
        engines["llama.cpp"] = ref
    else:
        print("llama-cpp-python is not installed: no llama.cpp column (make bench builds it)", file=sys.stderr)

    results = _alternate(engines, prompt, args.reps, args.decode)
    print(f"\n{'Default model' if args.model is None else 'Model'} ({path.name}), {args.threads} threads, prompt {args.prompt}, decode {args.decode}, "
          f"median of {args.reps} alternating repetitions\n")
    base = {k: statistics.median(v) for k, v in results.get("llama.cpp", {}).items()}
    print("| engine | prefill tok/s | decode tok/s | prefill ÷ llama.cpp | decode ÷ llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        p, d = statistics.median(r["prefill"]), statistics.median(r["decode"])
        rp = f"{p / base['prefill']:.2f}" if base else "–"
        rd = f"{d / base['decode']:.2f}" if base else "–"
        print(f"| {name} | {p:.1f} | {d:.1f} | {rp} | {rd} |")
    if GGUFModel(path).config.n_experts:
        _expert_bytes(path, {name: statistics.median(r["decode"]) for name, r in results.items()})


def _alternate(engines: dict, prompt: list[int], reps: int, decode: int,
               rotate: int = 0) -> dict[str, dict[str, list[float]]]:
    """Each engine's prefill and decode tok/s of each repetition (``prefill``, ``decode``: by wall
    time; ``prefill_cpu``, ``decode_cpu``: by CPU time), the engines alternated within it; each
    repetition starting ``rotate`` engines later than the one before (no engine always first)."""
    for pf, dc in engines.values():  # warm up
        pf(prompt)
        dc(prompt[:8], 4)
    results: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("prefill", "decode", "prefill_cpu", "decode_cpu")} for name in engines}
    names = list(engines)
    for rep in range(reps):
        start = rep * rotate % len(names)
        for name in names[start:] + names[:start]:
            pf, dc = engines[name]
            for what, (wall, cpu) in (("prefill", pf(prompt)), ("decode", dc(prompt[:16], decode))):
                results[name][what].append(wall)
                results[name][f"{what}_cpu"].append(cpu)
    return results


def _model_names(model: str | None) -> list[str | None]:
    if model is None:
        return [None]
    from benchmarks.big_model import FAMILY_SHAPES

    names: list[str | None] = []
    for name in model.split(","):
        names += [f"bench:{shape}" for shape in FAMILY_SHAPES] if name == "bench:families" else [name]
    return names


def _model_path(name: str | None) -> Path:
    from exo_tui.models.catalog import resolve_model

    return _bench_model(name[len("bench:"):]) if name and name.startswith("bench:") else resolve_model(name)


def _side_by_side(paths: list[Path], args: argparse.Namespace, prompt: list[int]) -> None:
    """Several models, each in exo-tui's default ONNX engine and in llama.cpp, all alternated in
    each repetition, each repetition starting at the next model; each one's ratios to llama.cpp beside the first model's, and the time a token
    each engine spends on it beyond the first model's (a family's extra ops, at one width).

    Other work on the machine only ever slows a repetition, and llama.cpp's threads by far the
    most (each op waits for its slowest thread), so the figures are the fastest repetition's,
    with the median of each repetition's own ratio and that ratio's range beside them."""
    engines: dict[str, tuple[Callable, Callable]] = {}
    for path in paths:
        engines[f"{path.name} exo-tui"] = _ours("onnx", path, args.threads)
        ref = _llama_cpp(path, args.threads)
        if ref is None:
            raise SystemExit("llama-cpp-python is not installed: nothing to compare with (make bench builds it)")
        engines[f"{path.name} llama.cpp"] = ref
    r = _alternate(engines, prompt, args.reps, args.decode, rotate=2)  # a model's two engines stay together
    if args.raw:
        args.raw.write_text(json.dumps({"threads": args.threads, "prompt": args.prompt, "decode": args.decode,
                                        "tok_s": r}, indent=1))

    for clock in ("", "_cpu"):
        _side_by_side_tables(paths, r, args, clock)


def _side_by_side_tables(paths: list[Path], r: dict[str, dict[str, list[float]]], args: argparse.Namespace,
                         clock: str) -> None:
    def reps(path: Path, engine: str, what: str) -> list[float]:
        return r[f"{path.name} {engine}"][what + clock]

    def best(path: Path, engine: str, what: str) -> float:
        return max(reps(path, engine, what))

    def ratio(path: Path, what: str) -> str:
        each = [a / b for a, b in zip(reps(path, "exo-tui", what), reps(path, "llama.cpp", what), strict=True)]
        return (f"{best(path, 'exo-tui', what) / best(path, 'llama.cpp', what):.2f}; "
                f"{statistics.median(each):.2f} ({min(each):.2f}-{max(each):.2f})")

    def extra(path: Path, engine: str, what: str) -> str:  # ms a token beyond the first model's
        return f"{1e3 * (1 / best(path, engine, what) - 1 / best(paths[0], engine, what)):+.2f}"

    by = "CPU time (the process's, all its threads)" if clock else "wall time"
    print(f"\n{len(paths)} models side by side, by {by}, {args.threads} threads, prompt {args.prompt}, "
          f"decode {args.decode}, {args.reps} repetitions, the {2 * len(paths)} engines alternated in each (each "
          f"repetition starting at the next model). "
          f"tok/s: the fastest repetition's; ratios: the fastest's, then the median of each repetition's (its range)\n")
    print("| model | exo-tui prefill / decode tok/s | llama.cpp prefill / decode tok/s | prefill ÷ llama.cpp | decode ÷ llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for path in paths:
        tok_s = [f"{best(path, e, 'prefill'):.1f} / {best(path, e, 'decode'):.2f}" for e in ("exo-tui", "llama.cpp")]
        print(f"| {path.name} | {tok_s[0]} | {tok_s[1]} | {ratio(path, 'prefill')} | {ratio(path, 'decode')} |")
    print(f"\nbeyond {paths[0].name}, by {by}: the time a token each engine spends on the model's extra ops "
          f"(fastest repetitions)\n")
    print("| model | decode ms a token, exo-tui | decode ms a token, llama.cpp | prefill ms a token, exo-tui | prefill ms a token, llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for path in paths[1:]:
        cells = [extra(path, e, w) for w in ("decode", "prefill") for e in ("exo-tui", "llama.cpp")]
        print(f"| {path.name} | {' | '.join(cells)} |")


def _bench_model(shape: str) -> Path:
    import platformdirs

    from benchmarks.big_model import model_path, shape_names, write_model

    if shape not in shape_names():
        raise SystemExit(f"bench:{shape}: no such shape; choose one of {', '.join(shape_names())}")
    cache = Path(platformdirs.user_cache_dir("exo-tui")) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    return write_model(model_path(cache, shape), shape)


def _expert_bytes(path: Path, decode_tok_s: dict[str, float]) -> None:
    """A mixture's bytes per decoded token: the layers' dense part, the chosen experts' share of
    the experts (k of E, one row's top-k being distinct experts) and the head."""
    from benchmarks.big_model import copy_gbps
    from exo_tui.models.gguf_file import GGUFModel
    from exo_tui.models.spec import spec_from_gguf

    model = GGUFModel(path)
    cfg, spec = model.config, spec_from_gguf(model)
    experts = sum(model.expert_nbytes(i) for i in range(cfg.n_layers))
    active_experts = experts * cfg.n_experts_used // cfg.n_experts
    token = sum(spec.active_layer_bytes) + spec.head_bytes
    gbps = copy_gbps()
    print(f"\n{cfg.n_experts} experts, {cfg.n_experts_used} used: a decoded token reads {token / 1e6:.0f} MB, "
          f"of them {active_experts / 1e6:.0f} MB of its chosen experts' (all experts: {experts / 1e6:.0f} MB); "
          f"NumPy copy {gbps:.1f} GB/s, a bound of {gbps * 1e9 / token:.0f} tok/s\n")
    print("| engine | decode tok/s | decode GB/s of the active bytes | ÷ copy GB/s |")
    print("|---|---:|---:|---:|")
    for name, tok_s in decode_tok_s.items():
        print(f"| {name} | {tok_s:.1f} | {tok_s * token / 1e9:.2f} | {tok_s * token / 1e9 / gbps:.2f} |")


if __name__ == "__main__":
    main()
