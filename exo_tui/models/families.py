"""Model families: how a GGUF file of each architecture describes its model.

One decoder (``backends/base.py``'s conventions) runs every family here; what differs is read
from the file into the :class:`~backends.base.ModelConfig`'s switches and into the layers' tensors:

=========  ===============================================================================
llama      Llama 2 and 3.x (``rope_freqs`` frequency factors; linear / YaRN scaling where the
           file says), Mistral and Mistral-Nemo (``key_length`` != hidden / heads), SmolLM,
           TinyLlama
qwen2      biases on q, k and v; rotary over the halves of a head (NeoX)
qwen3      RMSNorm of each q and k head before rotary; NeoX rotary
gemma3     embeddings times sqrt(hidden), norms after attention and MLP too, tanh-GELU MLP,
           q/k norms, sliding-window layers (every 6th global) with their own rotary base; NeoX
phi3       fused q/k/v and gate/up tensors (split at load), ``rope_factors_long/short``; NeoX
qwen3moe   qwen3 with a mixture of experts in every layer (router, top-k, renormalised)
llama+     ``expert_count`` in a llama file: Mixtral's mixture of experts
=========  ===============================================================================

Nothing in a file is ignored: every tensor must be one this module reads, and a metadata key that
asks for something no backend runs (an attention soft-cap, partial rotary, experts) refuses the
file with one sentence that names it and the supported list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import ModelConfig, unsupported_features
from backends.weights import QuantizedWeight, Weight

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe")
KNOWN_UNSUPPORTED = {
    "qwen2moe": "a mixture of experts with shared experts",
    "deepseek2": "a mixture of experts with latent attention",
    "gpt-oss": "a mixture of experts",
    "gemma2": "attention logit soft-capping",
    "gemma": "Gemma 1",
    "phi2": "partial rotary embedding",
    "mamba": "a state-space model",
}
GEMMA3_WINDOW_PATTERN = 6  # every 6th layer global (llama.cpp's default for gemma3 files)
GEMMA3_LOCAL_BASE = 10000.0


class FamilyError(Exception):
    """A file whose family or feature exo-tui does not run; the message is one sentence."""


@dataclass(frozen=True)
class Family:
    arch: str
    neox: bool = False  # the file's q/k rotate a head's halves: rows permuted to adjacent pairs at load
    fused_qkv: bool = False  # attn_qkv holds q, k and v (phi3)
    fused_gate_up: bool = False  # ffn_up holds gate then up (phi3)
    bias: bool = False  # attn_{q,k,v}.bias
    qk_norm: bool = False  # attn_{q,k}_norm.weight
    post_norms: bool = False  # post_attention_norm, post_ffw_norm

    def layer_tensors(self, experts: bool = False) -> dict[str, str]:
        """``LayerWeights`` field -> GGUF tensor name (without ``blk.N.``) of what the file stores;
        ``experts``: the layer's MLP is a mixture of experts (stacked ``*_exps`` tensors)."""
        names = {"attn_norm": "attn_norm.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight"}
        if self.fused_qkv:
            names["wqkv"] = "attn_qkv.weight"
        else:
            names |= {"wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight"}
        if experts:
            names |= {"router": "ffn_gate_inp.weight", "experts_gate": "ffn_gate_exps.weight",
                      "experts_up": "ffn_up_exps.weight", "experts_down": "ffn_down_exps.weight"}
        elif self.fused_gate_up:
            names |= {"w_gate_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
        else:
            names |= {"w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
        if self.bias:
            names |= {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
        if self.qk_norm:
            names |= {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
        if self.post_norms:
            names |= {"attn_post_norm": "post_attention_norm.weight", "ffn_post_norm": "post_ffw_norm.weight"}
        return names


FAMILIES = {
    "llama": Family("llama"),
    "qwen2": Family("qwen2", neox=True, bias=True),
    "qwen3": Family("qwen3", neox=True, qk_norm=True),
    "gemma3": Family("gemma3", neox=True, qk_norm=True, post_norms=True),
    "phi3": Family("phi3", neox=True, fused_qkv=True, fused_gate_up=True),
    "qwen3moe": Family("qwen3moe", neox=True, qk_norm=True),
}
MOE_ARCHITECTURES = ("llama", "qwen3moe")  # where expert_count is read (Mixtral is llama with experts)
# Whole-model tensors a family reads into its config rather than into a shard.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
END_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")


def family_of(arch: str, source: str) -> Family:
    family = FAMILIES.get(arch)
    if family is not None:
        return family
    what = f" ({KNOWN_UNSUPPORTED[arch]})" if arch in KNOWN_UNSUPPORTED else ""
    raise FamilyError(
        f"{source} has architecture {arch or 'unknown'!r}{what}, which exo-tui does not run yet; "
        f"it runs {', '.join(SUPPORTED_ARCHITECTURES)}: choose a GGUF of one of those families"
    )


def refuse(source: str, arch: str, feature: str) -> FamilyError:
    return FamilyError(
        f"{source} ({arch}) uses {feature}, which exo-tui does not run yet, so it is refused rather "
        f"than run without it; supported: {', '.join(SUPPORTED_ARCHITECTURES)} without it"
    )


def read_config(
    arch: str,
    field: Callable[[str, Any], Any],
    tensor_shape: Callable[[str], tuple[int, ...] | None],
    tensor_values: Callable[[str], np.ndarray],
    source: str,
) -> ModelConfig:
    """The model's :class:`ModelConfig` from its metadata (``field(key, default)``) and the few
    whole-model tensors that are configuration (rope frequency factors)."""
    family_of(arch, source)
    a = arch

    def need(key: str) -> Any:
        value = field(f"{a}.{key}", None)
        if value is None:
            raise FamilyError(f"{source} lacks metadata {a}.{key}: the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = field(f"{a}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts (some newer files)
        if len(set(n_kv)) != 1:
            raise refuse(source, a, "a different number of KV heads per layer")
        n_kv = n_kv[0]
    head_dim = int(field(f"{a}.attention.key_length", hidden // n_heads))
    value_dim = int(field(f"{a}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise refuse(source, a, f"values of {value_dim} per head beside keys of {head_dim}")
    n_layers = int(need("block_count"))
    vocab = field(f"{a}.vocab_size", None)
    if vocab is None:
        shape = tensor_shape("token_embd.weight")
        vocab = shape[0] if shape else 0
    rot = field(f"{a}.rope.dimension_count", head_dim)
    if int(rot) != head_dim:
        raise refuse(source, a, f"rotary embedding over {rot} of each head's {head_dim} dimensions (partial rotary)")
    experts = _experts(a, field, source)
    for key in ("attn_logit_softcapping", "attention.logit_softcapping"):
        if field(f"{a}.{key}", 0):
            raise refuse(source, a, "attention logit soft-capping")
    context = int(field(f"{a}.context_length", 2048))
    values: dict[str, Any] = dict(
        n_layers=n_layers, hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        n_heads=n_heads, n_kv_heads=int(n_kv), head_dim=head_dim, vocab_size=int(vocab),
        rms_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)), context_length=context, arch=a,
    )
    family = FAMILIES[a]
    values |= dict(qkv_bias=family.bias, qk_norm=family.qk_norm, post_norms=family.post_norms) | experts
    values |= _rope_scaling(a, field, tensor_shape, tensor_values, source, head_dim, context)
    softcap = float(field(f"{a}.final_logit_softcapping", 0.0) or 0.0)
    values["logit_softcap"] = softcap
    scale = field(f"{a}.attention.scale", None)
    if scale:
        values["attn_scale"] = float(scale)
    if a == "gemma3":
        values |= _gemma3(field, n_layers, hidden, n_heads, head_dim)
    elif a == "phi3":
        window = int(field(f"{a}.attention.sliding_window", 0) or 0)
        if window and window < context:
            values |= dict(sliding_window=window, window_layers=(True,) * n_layers)
    config = ModelConfig(**values)
    problems = unsupported_features(config, experts=True)
    if problems:
        raise refuse(source, a, problems[0])
    return config


def _experts(a: str, field: Callable[[str, Any], Any], source: str) -> dict:
    n = int(field(f"{a}.expert_count", 0) or 0)
    if not n:
        if a == "qwen3moe":
            raise FamilyError(f"{source} is qwen3moe but lacks metadata {a}.expert_count: the file is incomplete")
        return {}
    if a not in MOE_ARCHITECTURES:
        raise refuse(source, a, f"a mixture of {n} experts")
    if field(f"{a}.expert_shared_count", 0):
        raise refuse(source, a, "shared experts")
    if field(f"{a}.leading_dense_block_count", 0):
        raise refuse(source, a, "dense layers before the experts")
    if not field(f"{a}.expert_used_count", 0):
        raise FamilyError(f"{source} has {n} experts but lacks metadata {a}.expert_used_count: the file is incomplete")
    gating = int(field(f"{a}.expert_gating_func", 1) or 1)
    if gating != 1:
        raise refuse(source, a, "expert gating other than softmax")
    return dict(
        n_experts=n, n_experts_used=int(field(f"{a}.expert_used_count", 0) or 0),
        expert_intermediate_size=int(field(f"{a}.expert_feed_forward_length", 0) or 0),
        # llama.cpp's rule where the file does not say: Mixtral and Qwen3-MoE renormalise the top-k
        expert_weights_norm=bool(field(f"{a}.expert_weights_norm", True)),
    )


def _gemma3(field: Callable[[str, Any], Any], n_layers: int, hidden: int, n_heads: int, head_dim: int) -> dict:
    a = "gemma3"
    window = int(field(f"{a}.attention.sliding_window", 0) or 0)
    pattern = field(f"{a}.attention.sliding_window_pattern", None)
    if isinstance(pattern, list):  # per layer: true where windowed
        layers = tuple(bool(p) for p in pattern)
    else:
        every = int(pattern or GEMMA3_WINDOW_PATTERN)
        layers = tuple((i + 1) % every != 0 for i in range(n_layers))
    # llama.cpp's rule, as the file does not say: Gemma 3 27B (62 layers) scales queries by
    # (hidden / heads) ** -0.5 (its query_pre_attn_scalar), the others by head_dim ** -0.5.
    scale = field(f"{a}.attention.scale", None) or (
        (hidden / n_heads) ** -0.5 if n_layers == 62 else head_dim ** -0.5
    )
    return dict(
        activation="gelu_tanh", embed_scale=math.sqrt(hidden), attn_scale=float(scale),
        sliding_window=window, window_layers=layers if window else (),
        rope_theta_local=float(field(f"{a}.rope.freq_base_swa", GEMMA3_LOCAL_BASE) or GEMMA3_LOCAL_BASE),
    )


def _rope_scaling(a: str, field, tensor_shape, tensor_values, source: str, head_dim: int, context: int) -> dict:
    out: dict[str, Any] = {}
    kind = str(field(f"{a}.rope.scaling.type", "none") or "none")
    factor = float(field(f"{a}.rope.scaling.factor", 1.0) or 1.0)
    original = int(field(f"{a}.rope.scaling.original_context_length", 0) or 0)
    attn_factor = float(field(f"{a}.rope.scaling.attn_factor", 1.0) or 1.0)
    if kind == "linear" and factor != 1.0:
        out |= dict(rope_scaling="linear", rope_factor=factor)
    elif kind == "yarn":
        out |= dict(
            rope_scaling="yarn", rope_factor=factor, rope_original_context=original,
            rope_yarn_beta_fast=float(field(f"{a}.rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            rope_yarn_beta_slow=float(field(f"{a}.rope.scaling.yarn_beta_slow", 1.0) or 1.0),
        )
        attn_factor *= 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
    elif kind not in ("none", "linear"):
        raise refuse(source, a, f"rope scaling {kind!r}")
    factors = None
    if tensor_shape("rope_freqs.weight") is not None:
        factors = tensor_values("rope_freqs.weight")
    elif tensor_shape("rope_factors_long.weight") is not None:
        # llama.cpp's choice: the long factors when the context used exceeds the original one
        original = int(field(f"{a}.rope.scaling.original_context_length", 0) or 0) or context
        long = context > original
        factors = tensor_values("rope_factors_long.weight" if long else "rope_factors_short.weight")
        out["rope_original_context"] = original
    if factors is not None:
        factors = np.asarray(factors, dtype=np.float64).reshape(-1)
        if factors.shape[0] != head_dim // 2:
            raise refuse(source, a, f"{factors.shape[0]} rope frequency factors for {head_dim // 2} rotary pairs")
        out["rope_freq_factors"] = tuple(float(f) for f in factors)
    out["rope_attn_factor"] = attn_factor
    return out


def neox_to_adjacent(head_dim: int) -> np.ndarray:
    """The row order that turns a head rotated by halves (pairs ``i, i + d/2``) into one rotated by
    adjacent pairs (``2i, 2i + 1``): new row ``2i`` is old row ``i``, new ``2i + 1`` old ``i + d/2``."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


def permute_heads(w: Weight | np.ndarray, n_heads: int, head_dim: int) -> Weight:
    """Rows of each of ``n_heads`` heads of ``w`` (a matrix or a vector) in adjacent-pair order."""
    order = (np.arange(n_heads)[:, None] * head_dim + neox_to_adjacent(head_dim)[None, :]).reshape(-1)
    if isinstance(w, QuantizedWeight):
        return w.take_rows(order)
    return np.ascontiguousarray(np.asarray(w)[order])


def split_rows(w: Weight, sizes: list[int]) -> list[Weight]:
    """``w``'s rows in consecutive parts of ``sizes`` (a fused q/k/v or gate/up matrix)."""
    edges = np.cumsum([0, *sizes])
    if edges[-1] != w.shape[0]:
        raise FamilyError(f"a fused matrix of {w.shape[0]} rows cannot split into {sizes}")
    parts: list[np.ndarray | QuantizedWeight] = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        if isinstance(w, QuantizedWeight):
            parts.append(w.take_rows(slice(a, b)))
        else:
            parts.append(np.asarray(w)[a:b])
    return parts
