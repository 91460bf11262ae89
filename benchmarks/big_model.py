"""Models of real sizes in Q4_K_M layout, on one node beside llama.cpp, and across three nodes each
given less memory than the model.

Writes (once, into the cache folder; no download) random-weight GGUFs with Llama-3.1-8B's and
Llama-3.2-1B's shapes in llama.cpp's Q4_K_M layout (Q4_K matrices; Q6_K for ``attn_v`` and
``ffn_down`` in the first and last eighths and every third layer between, and for the output head),
their blocks random codes with sane float16 scales, and a byte-level vocabulary of the real size.
Then reports, side by side with llama.cpp on the same file and threads:

* one node: prefill and decode tok/s and the peak RSS of each engine, measured in a process of its
  own; the bytes a decoded token reads and the GB/s that makes, next to a NumPy copy's GB/s;
* ``--nodes 3``: three node processes with ``--memory-limit`` below the model's size, the plan's
  shares, decode tok/s, and the stall when one node is drained mid-answer.

    python benchmarks/big_model.py [--shape 1b|8b] [--threads 2] [--nodes 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocab, tied
    "1b": (16, 2048, 8192, 32, 8, 128256, True),
    "8b": (32, 4096, 14336, 32, 8, 128256, False),
}
MOE_SHAPES = {  # layers, hidden, heads, kv heads, head_dim, experts, used, expert width, vocab
    # Qwen3-30B-A3B's layers (hidden 2048, 128 experts of width 768, top 8), 4 of its 48; a
    # vocabulary whose Q6_K head is about the same share of a token's bytes as the real one's
    "moe": (4, 2048, 32, 4, 128, 128, 8, 768, 16384),
}


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: Q4_K_M's Q6_K layers for attn_v and ffn_down."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def model_path(cache: Path, shape: str) -> Path:
    arch = "qwen3moe" if shape in MOE_SHAPES else "llama"
    return cache / f"random-{arch}-{shape}-Q4_K_M.gguf"


def write_model(path: Path, shape: str) -> Path:
    """The random Q4_K_M file of ``shape`` (a dense llama of :data:`SHAPES` or a qwen3moe of
    :data:`MOE_SHAPES`; written once, an existing file is kept)."""
    import gguf

    if path.exists():
        return path
    if shape in MOE_SHAPES:
        n_layers, hidden, heads, kv_heads, head_dim, experts, used, width, vocab = MOE_SHAPES[shape]
        arch, tied, ffn = "qwen3moe", False, width
        fields = {"expert_count": experts, "expert_used_count": used, "expert_feed_forward_length": width,
                  "attention.key_length": head_dim, "attention.value_length": head_dim}
    else:
        n_layers, hidden, ffn, heads, kv_heads, vocab, tied = SHAPES[shape]
        arch, head_dim, experts = "llama", hidden // heads, 0
        fields = {"rope.dimension_count": head_dim, "vocab_size": vocab}
    fields |= {"block_count": n_layers, "context_length": 8192, "embedding_length": hidden,
               "feed_forward_length": ffn, "attention.head_count": heads, "attention.head_count_kv": kv_heads}
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, hidden), "Q4_K")]
    for i in range(n_layers):
        more = _more_bits(i, n_layers)
        plan += [
            (f"blk.{i}.attn_norm.weight", (hidden,), "F32"),
            (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), "Q4_K"),
            (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), "Q4_K"),
            (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), "Q6_K" if more else "Q4_K"),
            (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), "Q4_K"),
            (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
        ]
        if experts:  # qwen3's head norms, the router, the experts stacked (llama.cpp's Q4_K_M of a MoE)
            plan += [
                (f"blk.{i}.attn_q_norm.weight", (head_dim,), "F32"),
                (f"blk.{i}.attn_k_norm.weight", (head_dim,), "F32"),
                (f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), "F32"),
                (f"blk.{i}.ffn_gate_exps.weight", (experts, ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_up_exps.weight", (experts, ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_down_exps.weight", (experts, hidden, ffn), "Q6_K" if more else "Q4_K"),
            ]
        else:
            plan += [
                (f"blk.{i}.ffn_gate.weight", (ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_up.weight", (ffn, hidden), "Q4_K"),
                (f"blk.{i}.ffn_down.weight", (hidden, ffn), "Q6_K" if more else "Q4_K"),
            ]
    plan.append(("output_norm.weight", (hidden,), "F32"))
    if not tied:
        plan.append(("output.weight", (vocab, hidden), "Q6_K"))
    _write(path, arch, f"random-{arch}-{shape}-Q4_K_M", fields, plan, vocab, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    return path


def _write(path: Path, arch: str, name: str, fields: dict[str, int], plan: list[tuple[str, tuple[int, ...], str]],
           vocab: int, file_type: int) -> None:
    """A GGUF of ``arch`` with the integer metadata ``fields`` (keys after ``arch.``) and the
    tensors of ``plan`` (name, dims, type: F32 vectors and matrices, random K-quant blocks for
    matrices and stacks of matrices), a byte-level vocabulary of ``vocab`` tokens."""
    import gguf

    from backends.base import KQUANT_BLOCK_BYTES
    from tests.factory import CHAT_TEMPLATE, random_kquant_blocks, tiny_vocab

    rng = np.random.default_rng(0)
    tokens, types, merges = tiny_vocab()
    tokens = tokens + [f"<unused_{i}>" for i in range(vocab - len(tokens))]
    types = types + [1] * (vocab - len(types))
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(name)
    for key, value in fields.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(file_type)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name_, dims, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name_, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            *lead, cols = dims
            nbytes = int(np.prod(lead)) * cols // 256 * KQUANT_BLOCK_BYTES[kind]
            w.add_tensor_info(name_, (*lead, cols // 256 * KQUANT_BLOCK_BYTES[kind]), np.dtype(np.uint8), nbytes,
                              raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name_, dims, kind in plan:
        if kind == "F32":
            if len(dims) == 1:
                w.write_tensor_data((1 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32))
            else:  # a router: logits of a few units, so the softmax picks among the experts
                w.write_tensor_data((rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32))
        else:
            *lead, cols = dims
            rows = int(np.prod(lead))
            std = 1.0 if name_ == "token_embd.weight" else 1.0 / np.sqrt(cols)
            # a few thousand rows at a time in memory (the largest, the 8B's head: 431 MB of Q6_K blocks)
            pieces = [random_kquant_blocks(rng, min(4096, rows - a), cols, kind, std) for a in range(0, rows, 4096)]
            w.write_tensor_data(np.concatenate(pieces).reshape(*lead, -1))
    w.close()
    tmp.rename(path)


def _engine_child(engine: str, path: str, threads: int, prompt: int, tokens: int) -> None:
    """Runs in its own process: prefill and decode tok/s and the peak RSS (printed as JSON)."""
    import resource

    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(300, 5000, prompt)]
    t0 = time.perf_counter()
    if engine == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill = prompt / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        decode = tokens / (time.perf_counter() - t0)
    else:
        from backends.onnx import ONNXBackend
        from exo_tui.models.gguf_file import GGUFModel

        model = GGUFModel(path)
        cfg = model.config
        weights = model.shard_weights(0, cfg.n_layers)
        weights.disposable = True
        shard = ONNXBackend(threads=threads).load_shard(cfg, weights)
        del weights
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = shard.forward("r", np.array(ids), np.arange(prompt))
        prefill = prompt / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(tokens):
            logits = shard.forward("r", np.array([int(np.argmax(logits[-1]))]), np.array([prompt + i]))
        decode = tokens / (time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"prefill": prefill, "decode": decode, "peak_rss": peak, "load_s": load_s}))


def one_node(path: Path, threads: int, prompt: int, tokens: int) -> dict[str, dict]:
    out = {}
    engines = ["exo-tui onnx"]
    try:
        import llama_cpp  # noqa: F401

        engines.append("llama.cpp")
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp column (make bench builds it)", file=sys.stderr)
    for engine in engines:
        r = subprocess.run([sys.executable, __file__, "--child", engine, str(path), str(threads), str(prompt), str(tokens)],
                           capture_output=True, text=True, env={**os.environ, "EXO_TUI_THREADS": str(threads)})
        if r.returncode:
            print(f"{engine} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
            continue
        out[engine] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def copy_gbps() -> float:
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)  # read + write
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _engine_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES) + sorted(MOE_SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache", type=Path, default=None, help="where the model files go (default: exo-tui's cache)")
    args = ap.parse_args()

    import platformdirs

    cache = args.cache or Path(platformdirs.user_cache_dir("exo-tui")) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = write_model(model_path(cache, args.shape), args.shape)
    print(f"model {path} ({path.stat().st_size / 1e9:.2f} GB, ready in {time.perf_counter() - t0:.0f} s)")

    from exo_tui.models.gguf_file import GGUFModel

    model = GGUFModel(path)
    layer_bytes = sum(model.layer_nbytes(i) for i in range(model.config.n_layers))
    token_bytes = layer_bytes + (model.tensor_info("output.weight").nbytes if not model.tied_embeddings
                                 else model.embed_nbytes)
    results = one_node(path, args.threads, args.prompt, args.tokens)
    gbps = copy_gbps()
    print(f"\n{args.shape} shape, {args.threads} threads, prompt {args.prompt}, decode {args.tokens}; "
          f"a decoded token reads {token_bytes / 1e9:.2f} GB; NumPy copy {gbps:.1f} GB/s\n")
    base = results.get("llama.cpp")
    print("| engine | prefill tok/s | decode tok/s | decode GB/s | peak RSS GB | prefill ÷ llama.cpp | decode ÷ llama.cpp | RSS ÷ llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratios = ("–", "–", "–") if not base else (
            f"{r['prefill'] / base['prefill']:.2f}", f"{r['decode'] / base['decode']:.2f}",
            f"{r['peak_rss'] / base['peak_rss']:.2f}")
        print(f"| {name} | {r['prefill']:.1f} | {r['decode']:.2f} | {r['decode'] * token_bytes / 1e9:.1f} | "
              f"{r['peak_rss'] / 1e9:.2f} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main()
