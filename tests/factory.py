"""Tiny random llama GGUF files for tests: real files written with the ``gguf`` writer, with a
byte-level BPE tokenizer and a ChatML template so that every part of the stack can load them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

from backends.kquants import random_blocks as random_kquant_blocks  # noqa: F401 (the tests' name)
from backends.weights import KQUANT_BLOCK_BYTES
from exo_tui.models.tokenizer import bytes_to_unicode

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Special tokens, then the 256 byte tokens, then a few merged tokens."""
    b2u = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    merges = []
    for pair in ("th", "he", "in", "er", "an"):
        a, b = b2u[ord(pair[0])], b2u[ord(pair[1])]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, merges


def write_tiny_llama(
    path: str | Path,
    *,
    n_layers: int = 4,
    hidden: int = 64,
    intermediate: int = 128,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    context_length: int = 256,
    weight_type: str = "F32",
    embed_type: str | None = None,
    tied: bool = True,
    seed: int = 0,
    rope_theta: float = 10000.0,
    sampling: dict[str, float | int] | None = None,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    strings: dict[str, str] | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a random llama model; matrices in ``weight_type`` (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, or a K-quant).
    ``sampling``: recommended sampling fields, e.g. ``{"general.sampling.temp": 0.0}`` (any
    int/float metadata, in fact). ``arch``: the ``general.architecture`` written (the keys follow
    it); ``extra_tensors``: more float32 tensors by name (to make files exo-tui must refuse).
    ``split_max_tensors``: split into ``stem-0000K-of-0000N.gguf`` parts of at most that many
    tensors each (the path of the first part is returned)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    head_dim = hidden // n_heads
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny-llama")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, text in (strings or {}).items():
        w.add_string(key, text)
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            w.add_int32(key, value)
        else:
            w.add_float32(key, value)

    def matrix(name: str, rows: int, cols: int, qtype: str, scale: float) -> None:
        if qtype in KQUANT_BLOCK_BYTES:  # random blocks straight away (no float matrix to quantize)
            w.add_tensor(name, random_kquant_blocks(rng, rows, cols, qtype, scale),
                         raw_dtype=getattr(gguf.GGMLQuantizationType, qtype),
                         raw_shape=(rows, cols // 256 * KQUANT_BLOCK_BYTES[qtype]))
            return
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        add(name, values, qtype)

    def add(name: str, values: np.ndarray, qtype: str) -> None:
        if qtype in KQUANT_BLOCK_BYTES:
            t = getattr(gguf.GGMLQuantizationType, qtype)
            rows, cols = values.shape
            w.add_tensor(name, random_kquant_blocks(rng, rows, cols, qtype, float(values.std())), raw_dtype=t,
                         raw_shape=(rows, cols // 256 * KQUANT_BLOCK_BYTES[qtype]))
            return
        if qtype == "F32":
            w.add_tensor(name, values.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, values.astype(np.float16))
        else:
            t = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, quantize(values, t), raw_dtype=t)

    s = 1.0 / np.sqrt(hidden)
    matrix("token_embd.weight", vocab, hidden, embed_type or weight_type, 1.0)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), "F32")
        matrix(f"blk.{i}.attn_q.weight", n_heads * head_dim, hidden, weight_type, s)
        matrix(f"blk.{i}.attn_k.weight", n_kv_heads * head_dim, hidden, weight_type, s)
        matrix(f"blk.{i}.attn_v.weight", n_kv_heads * head_dim, hidden, weight_type, s)
        matrix(f"blk.{i}.attn_output.weight", hidden, n_heads * head_dim, weight_type, s)
        add(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), "F32")
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden, weight_type, s)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden, weight_type, s)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate, weight_type, 1.0 / np.sqrt(intermediate))
    add("output_norm.weight", np.ones(hidden, dtype=np.float32), "F32")
    if not tied:
        matrix("output.weight", vocab, hidden, weight_type, s)
    for name, values in (extra_tensors or {}).items():
        add(name, np.asarray(values, dtype=np.float32), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0] if split_max_tensors else path


