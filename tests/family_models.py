"""Tiny random models of each family's feature set, as a :class:`ModelConfig` and its weights (no
file): what the backends are held to against the NumPy reference, feature by feature. The real
files of each family (converted by llama.cpp from transformers' models) are in tests/fixtures/."""

from __future__ import annotations

import dataclasses

import numpy as np

from backends.base import ModelConfig
from backends.weights import LayerWeights, QuantizedWeight, ShardWeights

BASE = ModelConfig(n_layers=4, hidden_size=64, intermediate_size=96, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=96, rms_eps=1e-6, rope_theta=10000.0, context_length=64)


def _factors(n: int) -> tuple[float, ...]:
    return tuple(float(f) for f in np.linspace(1.0, 6.0, n))


FEATURES: dict[str, ModelConfig] = {
    "llama": BASE,
    "llama3-rope": dataclasses.replace(BASE, rope_freq_factors=_factors(8), rope_theta=500000.0),
    "linear-rope": dataclasses.replace(BASE, rope_scaling="linear", rope_factor=4.0),
    "yarn-rope": dataclasses.replace(BASE, rope_scaling="yarn", rope_factor=4.0, rope_original_context=16,
                                     rope_attn_factor=1.0 + 0.1 * np.log(4.0)),
    "wide-heads": dataclasses.replace(BASE, head_dim=24, arch="llama"),  # Mistral-Nemo: heads x head_dim != hidden
    "qwen2": dataclasses.replace(BASE, arch="qwen2", qkv_bias=True, rope_theta=1000000.0),
    "qwen3": dataclasses.replace(BASE, arch="qwen3", qk_norm=True, head_dim=32),
    "gemma3": dataclasses.replace(
        BASE, arch="gemma3", qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=8.0,
        attn_scale=0.2, sliding_window=5, window_layers=(True, True, False, True), rope_theta=1000000.0,
        rope_theta_local=10000.0, rope_scaling="linear", rope_factor=8.0, logit_softcap=0.0,
    ),
    "phi3-longrope": dataclasses.replace(BASE, arch="phi3", rope_freq_factors=_factors(8), rope_attn_factor=1.19,
                                         sliding_window=20, window_layers=(True,) * 4),
    "softcap": dataclasses.replace(BASE, logit_softcap=3.0),
}


def _matrix(rng: np.random.Generator, rows: int, cols: int, quantized: bool) -> np.ndarray | QuantizedWeight:
    if quantized:
        return QuantizedWeight.random(rng, rows, cols, bits=4)
    return (rng.standard_normal((rows, cols)) * (1.2 / np.sqrt(cols))).astype(np.float32)


def _vector(rng: np.random.Generator, n: int, around: float = 1.0, spread: float = 0.3) -> np.ndarray:
    return (around + spread * rng.standard_normal(n)).astype(np.float32)


def random_weights(config: ModelConfig, seed: int = 0, quantized: bool = False) -> ShardWeights:
    """The whole model's weights for ``config``, with every part its features ask for."""
    c = config
    rng = np.random.default_rng(seed)
    h, qd, kvd, ffn = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate_size
    layers = []
    for _ in range(c.n_layers):
        lw = LayerWeights(
            attn_norm=_vector(rng, h), wq=_matrix(rng, qd, h, quantized), wk=_matrix(rng, kvd, h, quantized),
            wv=_matrix(rng, kvd, h, quantized), wo=_matrix(rng, h, qd, quantized), ffn_norm=_vector(rng, h),
            w_gate=_matrix(rng, ffn, h, quantized), w_up=_matrix(rng, ffn, h, quantized),
            w_down=_matrix(rng, h, ffn, quantized),
        )
        if c.qkv_bias:
            lw.bq, lw.bk, lw.bv = (_vector(rng, n, 0.0, 0.5) for n in (qd, kvd, kvd))
        if c.qk_norm:
            lw.q_norm, lw.k_norm = _vector(rng, c.head_dim), _vector(rng, c.head_dim)
        if c.post_norms:
            lw.attn_post_norm, lw.ffn_post_norm = _vector(rng, h), _vector(rng, h)
        layers.append(lw)
    embed = (rng.standard_normal((c.vocab_size, h)) * (1.0 / np.sqrt(c.embed_scale))).astype(np.float32)
    output = _matrix(rng, c.vocab_size, h, False) * 3
    return ShardWeights(0, c.n_layers, layers, embed=embed, norm=_vector(rng, h), output=output)


def sub_shard(weights: ShardWeights, start: int, end: int) -> ShardWeights:
    """Layers ``[start, end)`` of a whole model's weights (the ends only where they belong)."""
    n = len(weights.layers)
    return ShardWeights(start, end, weights.layers[start:end], embed=weights.embed if start == 0 else None,
                        norm=weights.norm if end == n else None, output=weights.output if end == n else None)
