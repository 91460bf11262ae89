"""Models of real sizes in Q4_K_M layout, on one node beside llama.cpp, and across three nodes each
given less memory than the model.

Writes (once, into the cache folder; no download) random-weight GGUFs with Llama-3.1-8B's and
Llama-3.2-1B's shapes in llama.cpp's Q4_K_M layout (Q4_K matrices; Q6_K for ``attn_v`` and
``ffn_down`` in the first and last eighths and every third layer between, and for the 8B's output head;
the 1B's head is its tied Q4_K embedding, as in Llama-3.2-1B),
their blocks random codes with sane float16 scales, and a byte-level vocabulary of the real size.
The family shapes (``llama-2048``, ``qwen2-2048``, ``qwen3-2048``, ``gemma3-2048``, ``phi3-2048``)
are one width in each family: 8 of Llama-3.2-1B's layers and a 32k vocabulary, each with its
family's own tensors and metadata (q/k/v biases; q/k head norms; post-norms, tanh-GELU, embedding
scale and 512-token sliding windows; fused q/k/v and gate/up), so that beside the llama one only
the family's extra ops differ (phi3's fused q/k/v stays Q4_K, where llama.cpp's Q4_K_M makes it
Q5_K). The fallback shapes (``qwen2.5-0.5b``, ``gemma3-1b``) are those models' whole shapes in
llama.cpp's Q4_K_M layout, where a matrix whose rows are not whole super-blocks of 256 is Q5_0
(Q8_0 where Q4_K_M wants Q6_K): most of their matrices, and their tied embeddings.
Then reports, side by side with llama.cpp on the same file and threads:

* one node: prefill and decode tok/s and the peak RSS of each engine, measured in a process of its
  own; the bytes a decoded token reads and the GB/s that makes, next to a NumPy copy's GB/s;
* ``--local-nodes 3``: three node processes on this machine, each with a ``--memory-limit`` below
  the model's size (the memory it gives to models, above its runtime's own, enforced by the node; by
  default what lets the other two take a drained node's layers), the plan's shares (layers, their
  bytes, each node's resident memory and what of it lies above its runtime's baseline, against its limit), decode tok/s through the ring, and the stall when the middle node is drained
  mid-answer (the longest gap between two streamed tokens after the drain, against the usual one).
  The machine's cores are shared out between the nodes (``--threads`` in all).

    python benchmarks/big_model.py [--shape 1b|8b|qwen2.5-0.5b|gemma3-1b|...] [--threads 2] [--tokens 32] [--local-nodes 3]
                                   [--memory-limit GB] [--context TOKENS] [--no-one-node] [--reps 3]
                                   [--precision auto int16] [--mlx]

``--reps 3`` measures each engine three times, alternated, and reports the medians and each
round's ratios (on a shared machine only ratios of one round mean much).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quick import parse  # noqa: E402

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocab, tied
    "1b": (16, 2048, 8192, 32, 8, 128256, True),
    "8b": (32, 4096, 14336, 32, 8, 128256, False),
    "tiny": (2, 256, 512, 4, 2, 8192, True),  # --quick's: shows the benchmark runs
}
FAMILY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
FAMILY_WIDTH = (8, 2048, 8192, 32, 8, 32768, True)  # as SHAPES: 8 of Llama-3.2-1B's layers, a 32k vocabulary
FAMILY_SHAPES = {f"{arch}-{FAMILY_WIDTH[1]}": arch for arch in FAMILY_ARCHS}
FALLBACK_SHAPES = {  # as SHAPES (and a head size), in a family: real models whose rows are not whole K-quant super-blocks
    "qwen2.5-0.5b": ("qwen2", (24, 896, 4864, 14, 2, 151936, True), 64),
    "gemma3-1b": ("gemma3", (26, 1152, 6912, 4, 1, 262144, True), 256),  # its 262k-row embedding a third of it
}
FALLBACK_TYPES = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""What llama.cpp's quantizer writes for a matrix whose rows are not whole super-blocks of 256 (in a
Q4_K_M file of Qwen2.5-0.5B, width 896, every matrix but ``ffn_down``)."""
GEMMA3_WINDOW = 512  # Gemma 3 1B's sliding window
MOE_SHAPES = {  # layers, hidden, heads, kv heads, head_dim, experts, used, expert width, vocab
    # Qwen3-30B-A3B's layers (hidden 2048, 128 experts of width 768, top 8), 4 of its 48; a
    # vocabulary whose Q6_K head is about the same share of a token's bytes as the real one's
    "moe": (4, 2048, 32, 4, 128, 128, 8, 768, 16384),
}


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: Q4_K_M's Q6_K layers for attn_v and ffn_down."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def shape_names() -> list[str]:
    return [*SHAPES, *MOE_SHAPES, *FAMILY_SHAPES, *FALLBACK_SHAPES]


def model_path(cache: Path, shape: str) -> Path:
    if shape in FAMILY_SHAPES:
        return cache / f"random-{shape}x{FAMILY_WIDTH[0]}-Q4_K_M.gguf"
    if shape in FALLBACK_SHAPES:
        return cache / f"random-{shape}-Q4_K_M.gguf"
    arch = "qwen3moe" if shape in MOE_SHAPES else "llama"
    return cache / f"random-{arch}-{shape}-Q4_K_M.gguf"


def write_model(path: Path, shape: str) -> Path:
    """The random Q4_K_M file of ``shape`` (a dense llama of :data:`SHAPES`, a qwen3moe of
    :data:`MOE_SHAPES` or a family of :data:`FAMILY_SHAPES` or :data:`FALLBACK_SHAPES`; written once,
    an existing file is kept)."""
    import gguf

    if path.exists():
        return path
    if shape in FAMILY_SHAPES or shape in FALLBACK_SHAPES:
        _write_family(path, shape)
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


def _write_family(path: Path, shape: str) -> None:
    """:data:`FAMILY_WIDTH`'s dense model in the family ``FAMILY_SHAPES[shape]`` (or a model of
    :data:`FALLBACK_SHAPES`): llama's tensors and metadata plus the family's own, as llama.cpp's
    converter writes them. A tied embedding is the head, which Q4_K_M makes Q6_K."""
    import gguf

    arch, (n_layers, hidden, ffn, heads, kv_heads, vocab, tied), head_dim = FALLBACK_SHAPES.get(
        shape, (FAMILY_SHAPES.get(shape), FAMILY_WIDTH, FAMILY_WIDTH[1] // FAMILY_WIDTH[3]))
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    fields: dict[str, int | float] = {
        "block_count": n_layers, "context_length": 8192, "embedding_length": hidden, "feed_forward_length": ffn,
        "attention.head_count": heads, "attention.head_count_kv": kv_heads, "rope.dimension_count": head_dim,
        "attention.key_length": head_dim, "attention.value_length": head_dim, "vocab_size": vocab}
    if arch == "gemma3":  # windowed layers (every 6th global, llama.cpp's default) with their own rotary base
        fields |= {"attention.sliding_window": GEMMA3_WINDOW, "rope.freq_base_swa": 10000.0}
    embed = "Q6_K" if tied and shape in FALLBACK_SHAPES else "Q4_K"
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, hidden), embed)]
    for i in range(n_layers):
        more = _more_bits(i, n_layers)
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (hidden,), "F32"))
        if arch == "phi3":  # q, k and v in one matrix (Q4_K: the same blocks as llama's q and k)
            plan.append((b + "attn_qkv.weight", (q_rows + 2 * kv_rows, hidden), "Q4_K"))
        else:
            plan += [(b + "attn_q.weight", (q_rows, hidden), "Q4_K"), (b + "attn_k.weight", (kv_rows, hidden), "Q4_K"),
                     (b + "attn_v.weight", (kv_rows, hidden), "Q6_K" if more else "Q4_K")]
        if arch == "qwen2":
            plan += [(b + "attn_q.bias", (q_rows,), "F32"), (b + "attn_k.bias", (kv_rows,), "F32"),
                     (b + "attn_v.bias", (kv_rows,), "F32")]
        if arch in ("qwen3", "gemma3"):
            plan += [(b + "attn_q_norm.weight", (head_dim,), "F32"), (b + "attn_k_norm.weight", (head_dim,), "F32")]
        plan += [(b + "attn_output.weight", (hidden, q_rows), "Q4_K"), (b + "ffn_norm.weight", (hidden,), "F32")]
        if arch == "gemma3":
            plan += [(b + "post_attention_norm.weight", (hidden,), "F32"), (b + "post_ffw_norm.weight", (hidden,), "F32")]
        if arch == "phi3":  # gate then up in one matrix
            plan.append((b + "ffn_up.weight", (2 * ffn, hidden), "Q4_K"))
        else:
            plan += [(b + "ffn_gate.weight", (ffn, hidden), "Q4_K"), (b + "ffn_up.weight", (ffn, hidden), "Q4_K")]
        plan.append((b + "ffn_down.weight", (hidden, ffn), "Q6_K" if more else "Q4_K"))
    plan.append(("output_norm.weight", (hidden,), "F32"))
    # not "phi3" in the name: llama.cpp then looks for Phi-3's special tokens, which this vocabulary lacks
    name = f"random-{shape}-Q4_K_M".replace("phi3", "phi")
    _write(path, arch, name, fields, plan, vocab, gguf.LlamaFileType.MOSTLY_Q4_K_M)


def _write(path: Path, arch: str, name: str, fields: dict[str, int | float],
           plan: list[tuple[str, tuple[int, ...], str]], vocab: int, file_type: int) -> None:
    """A GGUF of ``arch`` with the metadata ``fields`` (keys after ``arch.``; ints as uint32, floats
    as float32) and the tensors of ``plan`` (name, dims, type: F32 vectors and matrices, random
    K-quant blocks for matrices and stacks of matrices, or llama.cpp's fallback type for them where
    the rows are not whole super-blocks: :data:`FALLBACK_TYPES`), a byte-level vocabulary of
    ``vocab`` tokens."""
    import gguf

    from tests.factory import CHAT_TEMPLATE, random_kquant_blocks, tiny_vocab

    plan = [(n, dims, FALLBACK_TYPES.get(kind, kind) if dims[-1] % 256 else kind) for n, dims, kind in plan]

    rng = np.random.default_rng(0)
    tokens, types, merges = tiny_vocab()
    tokens = tokens + [f"<unused_{i}>" for i in range(vocab - len(tokens))]
    types = types + [1] * (vocab - len(types))
    tmp = path.with_suffix(f".{os.getpid()}.part")  # one writer each: two processes may write it at once
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(name)
    for key, value in fields.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
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
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(name_, (*lead, cols // block * size), np.dtype(np.uint8),
                              int(np.prod(lead)) * cols // block * size, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name_, dims, kind in plan:
        if kind == "F32":
            if name_.endswith(".bias"):
                w.write_tensor_data((0.1 * rng.standard_normal(dims[0])).astype(np.float32))
            elif len(dims) == 1:
                w.write_tensor_data((1 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32))
            else:  # a router: logits of a few units, so the softmax picks among the experts
                w.write_tensor_data((rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32))
        else:
            *lead, cols = dims
            rows = int(np.prod(lead))
            std = 1.0 if name_ == "token_embd.weight" else 1.0 / np.sqrt(cols)
            # a few thousand rows at a time in memory (the largest, the 8B's head: 431 MB of Q6_K blocks)
            blocks = random_kquant_blocks if kind.endswith("_K") else _random_legacy_blocks
            pieces = [blocks(rng, min(4096, rows - a), cols, kind, std) for a in range(0, rows, 4096)]
            w.write_tensor_data(np.concatenate(pieces).reshape(*lead, -1))
    w.close()
    tmp.replace(path)


def _random_legacy_blocks(rng: np.random.Generator, rows: int, cols: int, type_name: str, std: float) -> np.ndarray:
    """Random Q5_0 or Q8_0 blocks of 32 (random codes, a float16 scale that spreads the weights
    about ``std`` around 0), as uint8 rows."""
    spread = {"Q5_0": 9.2, "Q8_0": 73.9}[type_name]  # the std of uniform codes less their offset
    nb = cols // 32
    d = np.frombuffer(np.full((rows, nb), std / spread, np.float16).tobytes(), np.uint8).reshape(rows, nb, 2)
    codes = rng.integers(0, 256, (rows, nb, 20 if type_name == "Q5_0" else 32), dtype=np.uint8)
    return np.concatenate([d, codes], axis=2).reshape(rows, -1)


def _engine_child(engine: str, path: str, threads: int, prompt: int, tokens: int) -> None:
    """Runs in its own process: prefill and decode tok/s and the peak RSS (printed as JSON)."""
    import resource

    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(300, 5000, prompt)]
    t0 = time.perf_counter()
    if engine == "llama.cpp":
        from llama_cpp import Llama
        from single_node import llama_last_logits as _last_logits

        llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill = prompt / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(np.argmax(_last_logits(llm)))])
        decode = tokens / (time.perf_counter() - t0)
    else:
        from backends.mlx import MLXBackend
        from backends.onnx import ONNXBackend
        from exo_tui.models.gguf_file import GGUFModel

        model = GGUFModel(path)
        cfg = model.config
        weights = model.shard_weights(0, cfg.n_layers)
        weights.disposable = True
        backend = MLXBackend(threads=threads) if engine == MLX_ENGINE else \
            ONNXBackend(threads=threads, precision=engine.split()[-1])
        shard = backend.load_shard(cfg, weights)
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


MLX_ENGINE = "exo-tui mlx"


def one_node(path: Path, threads: int, prompt: int, tokens: int, reps: int = 1,
             precisions: tuple[str, ...] = ("auto",), mlx: bool = False) -> dict[str, list[dict]]:
    """Each engine's measurements (exo-tui's ONNX at each of ``precisions``, and MLX's where
    ``mlx``), ``reps`` rounds with the engines alternated in each."""
    out: dict[str, list[dict]] = {}
    engines = [f"exo-tui onnx {p}" for p in precisions] + ([MLX_ENGINE] if mlx else [])
    try:
        import llama_cpp  # noqa: F401

        engines.append("llama.cpp")
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp column (make bench builds it)", file=sys.stderr)
    for _ in range(reps):
        for engine in engines:
            r = subprocess.run([sys.executable, __file__, "--child", engine, str(path), str(threads), str(prompt),
                                str(tokens)], capture_output=True, text=True,
                               env={**os.environ, "EXO_TUI_THREADS": str(threads)})
            if r.returncode:
                raise SystemExit(f"{engine} failed:\n{r.stderr[-3000:]}")
            out.setdefault(engine, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
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


GROWTH_GB = 0.1  # a node's reserve for a step and its runtime's growth once it holds shards, roughly (node/kv_budget.py)


def plan_need_bytes(model, context: int) -> int:  # noqa: ANN001
    """What a plan counts the whole model needs: its bytes and every layer's float16 KV caches at
    the context it is served at (the scheduler's count, on the ONNX backend's integer precisions)."""
    c = model.config
    return model.nbytes + c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2 * context


def default_limit_gb(model_bytes: int, need_bytes: int, nodes: int) -> tuple[float, bool]:
    """A per-node limit below the model's size that lets ``nodes - 1`` nodes hold it (its need),
    and whether it does: capped below the model's size, it may not."""
    wanted = GROWTH_GB + 1.2 * need_bytes / max(1, nodes - 1) / 1e9
    cap = 0.95 * model_bytes / 1e9
    return round(min(wanted, cap), 2), wanted <= cap


async def _ring(path: Path, nodes: int, limit_gb: float, threads: int, tokens: int, at: int, home: Path,
                context: int) -> dict:
    import statistics

    import psutil

    from exo_tui.cluster.coordinator import Coordinator
    from exo_tui.cluster.view import Command
    from exo_tui.config import Config
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import SamplingParams

    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 30.0  # nodes loading on shared cores answer late
    config.models.context_length = context
    os.environ["EXO_TUI_THREADS"] = str(max(1, threads // nodes))
    t0 = time.perf_counter()
    c = Coordinator(model=str(path), local_nodes=nodes, local_backends=["onnx"], local_memory_limits_gb=[limit_gb] * nodes,
                    strategy="memory", config=config, home=home, persist=False)
    await c.start()
    try:
        ready_s = time.perf_counter() - t0

        def shares() -> list[tuple[str, int, int, int, int, int, int]]:
            out = []
            for s in c.plan.shards:
                h = c.nodes[s.node_id]
                rss = psutil.Process(h.local_process.pid).memory_info().rss if h.local_process else 0
                kv = h.metrics.get("kv") or {}
                budget, baseline = int(kv.get("budget_bytes", 0)), int(kv.get("runtime_baseline_bytes", 0))
                out.append((h.name, s.start, s.end, c.spec.range_bytes(s.start, s.end, 0, s.backend or None), rss, baseline,
                            budget))
            return out

        plan_before = shares()
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(300, 5000, 32)]
        request = Request(prompt, SamplingParams(temperature=0.0, seed=1), tokens)
        stamps: list[float] = []
        drain_at: float | None = None
        drain: asyncio.Task | None = None

        async def drain_middle() -> str:
            victim = c.plan.shards[len(c.plan.shards) // 2].node_id
            result = await c.apply(await c.preview(Command("drain", (victim,))))
            return result.error

        failed = ""
        try:
            async for chunk in c.generate(request):
                if chunk.token_id is None:
                    continue
                stamps.append(time.perf_counter())
                if len(stamps) == at:
                    drain_at = time.perf_counter()
                    drain = asyncio.create_task(drain_middle())
        except Exception as exc:  # the answer's failure is a result here: reported with the numbers
            failed = f"{type(exc).__name__}: {exc}"
        if failed and len(stamps) < 3:
            return {"ready_s": ready_s, "before": plan_before, "after": shares(), "failed": failed}
        error = await drain if drain is not None else "the answer ended before the drain"
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        usual = statistics.median(gaps[1 : at - 1]) if at > 3 else float("nan")
        after = [g for t, g in zip(stamps[1:], gaps, strict=False) if drain_at is not None and t > drain_at]
        late = after[len(after) // 2 :]
        return {"ready_s": ready_s, "before": plan_before, "after": shares(), "decode": 1 / usual if usual else 0.0,
                "stall": max(after) if after else 0.0, "usual_gap": usual, "error": error,
                "decode_after": 1 / statistics.median(late) if late else 0.0, "tokens": len(stamps), "failed": failed}
    finally:
        await c.stop()


def local_nodes(path: Path, nodes: int, limit_gb: float | None, threads: int, tokens: int, context: int) -> None:
    import tempfile

    from exo_tui.config import DEFAULT_CONTEXT
    from exo_tui.models.gguf_file import GGUFModel
    from exo_tui.models.spec import served_context
    from exo_tui.net import loop as event_loop

    model = GGUFModel(path)
    context = served_context(model.config.context_length, context or DEFAULT_CONTEXT)
    size, need = model.nbytes, plan_need_bytes(model, context)
    note = ""
    if not limit_gb:
        limit_gb, drainable = default_limit_gb(size, need, nodes)
        if not drainable:
            note = (f" (below the model's size, {nodes - 1} nodes cannot hold its {need / 1e9:.2f} GB with the "
                    f"caches at its context: the drain is refused; more nodes or --memory-limit let it move)")
    at = max(4, tokens // 3)
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as d:
        r = event_loop.run(_ring(path, nodes, limit_gb, threads, tokens, at, Path(d), context))
    print(f"\n{nodes} local nodes, --memory-limit {limit_gb:g} GB each (the model: {size / 1e9:.2f} GB, "
          f"{size / (limit_gb * 1e9):.1f}x a limit, served at {context} tokens){note}, "
          f"{max(1, threads // nodes)} thread(s) a node, ready in {r['ready_s']:.0f} s\n")
    print("| plan | node | layers | layer bytes GB | resident GB | runtime GB | above it, of the limit | KV budget MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for when in ("before", "after"):
        for name, start, end, nbytes, rss, baseline, budget in r[when]:
            print(f"| {when} the drain | {name} | {start}–{end - 1} | {nbytes / 1e9:.2f} | {rss / 1e9:.2f} | "
                  f"{baseline / 1e9:.2f} | {(rss - baseline) / (limit_gb * 1e9):.0%} | {budget / 1e6:.0f} |")
    if "decode" not in r:
        print(f"\nthe answer failed: {r['failed']}")
        return
    print(f"\ndecode through the ring {r['decode']:.2f} tok/s (a token every {r['usual_gap'] * 1000:.0f} ms); "
          f"middle node drained at token {at}: "
          + (f"refused ({r['error']})" if r["error"] else
             f"longest gap after it {r['stall']:.2f} s ({r['stall'] / r['usual_gap']:.0f}x the usual), "
             f"then {r['decode_after']:.2f} tok/s on {len(r['after'])} nodes")
          + f"; {r['tokens']} tokens streamed" + (f"; then it failed: {r['failed']}" if r["failed"] else ""))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _engine_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=shape_names())
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache", type=Path, default=None, help="where the model files go (default: exo-tui's cache)")
    ap.add_argument("--local-nodes", type=int, default=0, metavar="N", help="also run N node processes here (3)")
    ap.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                    help="each local node's --memory-limit (default: below the model, enough for N - 1 nodes)")
    ap.add_argument("--ring-tokens", type=int, default=120,
                    help="tokens of the answer across the local nodes (the drain comes at a third of them)")
    ap.add_argument("--context", type=int, default=0, metavar="TOKENS",
                    help="the context the local nodes' cluster serves the model at (default: models.context_length, "
                         "8192, the file's own): the plan keeps room for every layer's caches at it")
    ap.add_argument("--no-one-node", action="store_true", help="skip the one-node comparison with llama.cpp")
    ap.add_argument("--precision", nargs="+", default=["auto"], choices=["auto", "int16", "int8", "float32"],
                    help="one node: the ONNX backend's precisions to measure (auto, the default: int8 on these K-quant "
                         "files, as llama.cpp's activations; int16 the others' default)")
    ap.add_argument("--mlx", action="store_true",
                    help="one node: MLX too (on Linux its CPU build, whose scalar kernels take minutes on the 1B shape)")
    ap.add_argument("--reps", type=int, default=1,
                    help="one node: rounds of every engine, alternated (medians, and each round's ratios)")
    args = parse(ap, shape="tiny", prompt=8, tokens=4, local_nodes=2, ring_tokens=12, memory_limit=0.2, context=512)
    if args.local_nodes == 1:
        ap.error("--local-nodes needs at least 2 nodes (one is drained)")

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
    if not args.no_one_node:
        one_node_table(args, model, token_bytes)
    if args.local_nodes:
        local_nodes(path, args.local_nodes, args.memory_limit, args.threads, args.ring_tokens, args.context)


def one_node_table(args: argparse.Namespace, model, token_bytes: int) -> None:  # noqa: ANN001
    path = model.path
    rounds = one_node(path, args.threads, args.prompt, args.tokens, args.reps, tuple(args.precision), args.mlx)
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    gbps = copy_gbps()
    print(f"\n{args.shape} shape, {args.threads} threads, prompt {args.prompt}, decode {args.tokens}"
          f"{f', medians of {args.reps} alternated rounds' if args.reps > 1 else ''}; "
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
    for name in (n for n in rounds if args.reps > 1 and "llama.cpp" in rounds and n != "llama.cpp"):
        pairs = zip(rounds[name], rounds["llama.cpp"], strict=False)
        print(f"\n{name}, each round's prefill / decode ÷ llama.cpp: "
              + ", ".join(f"{a['prefill'] / b['prefill']:.2f} / {a['decode'] / b['decode']:.2f}" for a, b in pairs))


if __name__ == "__main__":
    main()
