"""The llama layers in MLX, in the shape of mlx-lm's ``models/llama.py``: Attention, MLP,
TransformerBlock and the shard's model, float32 throughout, quantized matrices kept quantized.

Rotary angles are computed on the host in float64 (``step_inputs``) and handed in as float32
cos/sin, like the NumPy reference: ``mx.fast.rope`` computes them in float32, which is off by
~1e-3 at position 8000, and on MLX's CPU build it is a dozen small ops anyway.

The KV cache of a request is a preallocated buffer per layer, ``(1, n_kv_heads, capacity,
head_dim)``; new keys and values are written into it at their position (``mx.slice_update``, which
MLX does in place when the old buffer has no other owner). A query at position ``p`` sees the keys
at positions ``<= p``, which is both the causal mask and the mask that hides the unused tail of the
buffer, so a decode step can attend over the whole buffer and keep fixed shapes (what lets
``mx.compile`` reuse one trace for every decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends.base import LayerWeights, ModelConfig, ShardWeights
from backends.mlx.quant import MLXWeight, fuse_rows, to_mlx


@dataclass(frozen=True)
class Step:
    """What every layer needs to know about the new tokens of one forward."""

    offset: mx.array  # int32 (1,): the first new position (where the cache is written)
    mask: mx.array  # bool (T, n_keys): query i sees key j
    cos: mx.array  # float32 (T, 1, head_dim): cos of each pair's angle, repeated for both elements
    sin: mx.array  # float32 (T, 1, head_dim): -sin for the first element of a pair, +sin for the second
    n_keys: int  # attend over the first n_keys cache positions


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs of ``x`` ``(B, T, heads, head_dim)``:
    ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)``, as ``x * cos + swap_pairs(x) * sin`` with
    :class:`Step`'s ``cos``/``sin`` (broadcast over the heads)."""
    b, t, h, d = x.shape
    swapped = x.reshape(b, t, h, d // 2, 2)[..., ::-1].reshape(b, t, h, d)
    return x * cos + swapped * sin


def step_inputs(config: ModelConfig, start: int, t: int, n_keys: int) -> Step:
    """The :class:`Step` of ``t`` new tokens at positions ``start ..``, attending over ``n_keys``
    cache positions; angles in float64 (``theta_i = p * rope_theta ** (-2i / head_dim)``)."""
    positions = np.arange(start, start + t)
    d = config.head_dim
    inv = config.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.repeat(np.cos(ang), 2, axis=-1)
    sin = np.repeat(np.sin(ang), 2, axis=-1)
    sin[:, 0::2] *= -1
    mask = np.arange(n_keys)[None, :] <= positions[:, None]
    return Step(
        offset=mx.array(np.array([start], dtype=np.int32)),
        mask=mx.array(mask),
        cos=mx.array(cos[:, None, :].astype(np.float32)),
        sin=mx.array(sin[:, None, :].astype(np.float32)),
        n_keys=n_keys,
    )


class Attention:
    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1) -> None:
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        fused = fuse_rows([w.wq, w.wk, w.wv])
        # one matmul for q, k and v when they share a format, else three
        self.qkv_proj = to_mlx(fused, f"{name}.attn_qkv", n_parts) if fused is not None else None
        self.q_proj = None if fused is not None else to_mlx(w.wq, f"{name}.attn_q", n_parts)
        self.k_proj = None if fused is not None else to_mlx(w.wk, f"{name}.attn_k", n_parts)
        self.v_proj = None if fused is not None else to_mlx(w.wv, f"{name}.attn_v", n_parts)
        self.o_proj = to_mlx(w.wo, f"{name}.attn_output", n_parts)

    def __call__(self, x: mx.array, step: Step, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        q, k, v = self.project(x, step.cos, step.sin)
        o, keys, values = self.attend(q, k, v, step, keys, values)
        return self.output(o), keys, values

    def decode_batch(
        self, x: mx.array, steps: list[Step], cos: mx.array, sin: mx.array, keys: list[mx.array], values: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """One new token of each of ``B`` requests, ``x`` ``(B, 1, hidden)``: one matmul for all,
        attention per request over its own cache."""
        q, k, v = self.project(x, cos, sin)
        outs, new_keys, new_values = [], [], []
        for i, (step, ks, vs) in enumerate(zip(steps, keys, values, strict=True)):
            o, ks, vs = self.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], step, ks, vs)
            outs.append(o)
            new_keys.append(ks)
            new_values.append(vs)
        return self.output(mx.concatenate(outs, axis=0)), new_keys, new_values

    def project(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k (rotated) and v as ``(B, heads, T, head_dim)``."""
        b, t, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj.matmul(x).reshape(b, t, nh + 2 * nkv, hd)
            qk = rope(qkv[:, :, : nh + nkv], cos, sin)  # q and k heads rotated together
            q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv :]
        else:
            q = rope(self.q_proj.matmul(x).reshape(b, t, nh, hd), cos, sin)
            k = rope(self.k_proj.matmul(x).reshape(b, t, nkv, hd), cos, sin)
            v = self.v_proj.matmul(x).reshape(b, t, nkv, hd)
        return tuple(a.transpose(0, 2, 1, 3) for a in (q, k, v))  # type: ignore[return-value]

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, step: Step, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Write k, v into the cache at ``step.offset`` and attend over its first ``step.n_keys``."""
        keys = mx.slice_update(keys, k, step.offset, axes=(2,))
        values = mx.slice_update(values, v, step.offset, axes=(2,))
        if step.n_keys < keys.shape[2]:
            k_seen, v_seen = keys[:, :, : step.n_keys], values[:, :, : step.n_keys]
        else:
            k_seen, v_seen = keys, values
        o = mx.fast.scaled_dot_product_attention(q, k_seen, v_seen, scale=self.scale, mask=step.mask)
        return o, keys, values

    def output(self, o: mx.array) -> mx.array:
        b, _, t, _ = o.shape
        return self.o_proj.matmul(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP:
    def __init__(self, w: LayerWeights, name: str, n_parts: int = 1) -> None:
        fused = fuse_rows([w.w_gate, w.w_up])
        self.gate_up_proj = to_mlx(fused, f"{name}.ffn_gate_up", n_parts) if fused is not None else None
        self.gate_proj = None if fused is not None else to_mlx(w.w_gate, f"{name}.ffn_gate", n_parts)
        self.up_proj = None if fused is not None else to_mlx(w.w_up, f"{name}.ffn_up", n_parts)
        self.down_proj = to_mlx(w.w_down, f"{name}.ffn_down", n_parts)
        self.intermediate = w.w_down.shape[1]

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up_proj is not None:
            gate, up = mx.split(self.gate_up_proj.matmul(x), [self.intermediate], axis=-1)
        else:
            gate, up = self.gate_proj.matmul(x), self.up_proj.matmul(x)
        return self.down_proj.matmul(gate * mx.sigmoid(gate) * up)


class TransformerBlock:
    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1) -> None:
        self.eps = config.rms_eps
        self.input_layernorm = mx.array(w.attn_norm, dtype=mx.float32)
        self.post_attention_layernorm = mx.array(w.ffn_norm, dtype=mx.float32)
        self.self_attn = Attention(config, w, name, n_parts)
        self.mlp = MLP(w, name, n_parts)

    def __call__(self, x: mx.array, step: Step, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        r, keys, values = self.self_attn(mx.fast.rms_norm(x, self.input_layernorm, self.eps), step, keys, values)
        return self.feed_forward(x + r), keys, values

    def decode_batch(
        self, x: mx.array, steps: list[Step], cos: mx.array, sin: mx.array, keys: list[mx.array], values: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        a = mx.fast.rms_norm(x, self.input_layernorm, self.eps)
        r, keys, values = self.self_attn.decode_batch(a, steps, cos, sin, keys, values)
        return self.feed_forward(x + r), keys, values

    def feed_forward(self, h: mx.array) -> mx.array:
        return h + self.mlp(mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps))


class ShardModel:
    """Layers ``[start, end)``, with the token embedding on the first shard and the final norm and
    output head on the last one (the head reuses the embedding's arrays when they are tied)."""

    def __init__(self, config: ModelConfig, weights: ShardWeights, n_parts: int = 1) -> None:
        self.config = config
        self.layers = [
            TransformerBlock(config, lw, f"blk.{weights.start + i}", n_parts) for i, lw in enumerate(weights.layers)
        ]
        self.embed_tokens: MLXWeight | None = (
            to_mlx(weights.embed, "token_embd", n_parts) if weights.embed is not None else None
        )
        self.norm = mx.array(weights.norm, dtype=mx.float32) if weights.norm is not None else None
        self.lm_head: MLXWeight | None = None
        if weights.output is not None:
            tied = weights.output is weights.embed and self.embed_tokens is not None
            self.lm_head = self.embed_tokens if tied else to_mlx(weights.output, "output", n_parts)

    def __call__(
        self, x: mx.array, step: Step, keys: list[mx.array], values: list[mx.array], last_only: bool = True
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """``x``: token ids ``(T,)`` on the first shard, else hidden ``(T, hidden)``. Returns hidden
        ``(T, hidden)`` or logits (``(1, vocab)`` with ``last_only``, else ``(T, vocab)``) and the
        updated caches."""
        h = self.embed_tokens.rows(x) if self.embed_tokens is not None else x
        h = h[None]
        new_keys, new_values = [], []
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            h, k, v = layer(h, step, k, v)
            new_keys.append(k)
            new_values.append(v)
        h = h[0]
        if last_only and self.lm_head is not None:
            h = h[-1:]
        return self.head(h), new_keys, new_values

    def decode_batch(
        self, x: mx.array, steps: list[Step], keys: list[list[mx.array]], values: list[list[mx.array]]
    ) -> tuple[mx.array, list[list[mx.array]], list[list[mx.array]]]:
        """One new token of each of ``B`` requests (``x``: ``(B,)`` ids or ``(B, hidden)``), with
        ``keys[r][layer]``: one matmul per weight for the batch. Returns ``(B, hidden | vocab)``."""
        h = self.embed_tokens.rows(x) if self.embed_tokens is not None else x
        h = h[:, None, :]
        cos = mx.concatenate([s.cos for s in steps])[:, None]  # (B, 1, 1, head_dim)
        sin = mx.concatenate([s.sin for s in steps])[:, None]
        by_layer_k = [list(ks) for ks in zip(*keys, strict=True)]  # [layer][request]
        by_layer_v = [list(vs) for vs in zip(*values, strict=True)]
        for li, layer in enumerate(self.layers):
            h, by_layer_k[li], by_layer_v[li] = layer.decode_batch(h, steps, cos, sin, by_layer_k[li], by_layer_v[li])
        new_keys = [list(ks) for ks in zip(*by_layer_k, strict=True)] if self.layers else [[] for _ in steps]
        new_values = [list(vs) for vs in zip(*by_layer_v, strict=True)] if self.layers else [[] for _ in steps]
        return self.head(h[:, 0]), new_keys, new_values

    def head(self, h: mx.array) -> mx.array:
        """Logits of hidden ``(T, hidden)`` on the last shard; the hidden itself elsewhere."""
        if self.lm_head is None:
            return h
        return self.lm_head.matmul(mx.fast.rms_norm(h, self.norm, self.config.rms_eps))
