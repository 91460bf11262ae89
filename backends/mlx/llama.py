"""The llama layers in MLX, in the shape of mlx-lm's ``models/llama.py``: Attention, MLP,
TransformerBlock and the shard's model, float32 throughout, quantized matrices kept quantized.

The KV cache of a request is a preallocated buffer per layer, ``(1, n_kv_heads, capacity,
head_dim)``; new keys and values are written into it at their position (``mx.slice_update``, which
MLX does in place when the old buffer has no other owner). A query at position ``p`` sees the keys
at positions ``<= p``, which is both the causal mask and the mask that hides the unused tail of the
buffer, so a decode step can attend over the whole buffer and keep fixed shapes (what lets
``mx.compile`` reuse one trace for every decode step).
"""

from __future__ import annotations

import math

import mlx.core as mx

from backends.base import LayerWeights, ModelConfig, ShardWeights
from backends.mlx.quant import MLXWeight, fuse_rows, to_mlx


class Attention:
    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1) -> None:
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.scale = 1.0 / math.sqrt(config.head_dim)
        fused = fuse_rows([w.wq, w.wk, w.wv])
        # one matmul for q, k and v when they share a format, else three
        self.qkv_proj = to_mlx(fused, f"{name}.attn_qkv", n_parts) if fused is not None else None
        self.q_proj = None if fused is not None else to_mlx(w.wq, f"{name}.attn_q", n_parts)
        self.k_proj = None if fused is not None else to_mlx(w.wk, f"{name}.attn_k", n_parts)
        self.v_proj = None if fused is not None else to_mlx(w.wv, f"{name}.attn_v", n_parts)
        self.o_proj = to_mlx(w.wo, f"{name}.attn_output", n_parts)
        q_rows = self.n_heads * self.head_dim
        self.splits = [q_rows, q_rows + self.n_kv_heads * self.head_dim]

    def __call__(
        self, x: mx.array, offset: mx.array, mask: mx.array, keys: mx.array, values: mx.array, n_keys: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = mx.split(self.qkv_proj.matmul(x), self.splits, axis=-1)
        else:
            q, k, v = self.q_proj.matmul(x), self.k_proj.matmul(x), self.v_proj.matmul(x)
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, self.head_dim, traditional=True, base=self.rope_theta, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.head_dim, traditional=True, base=self.rope_theta, scale=1.0, offset=offset)
        keys = mx.slice_update(keys, k, offset, axes=(2,))
        values = mx.slice_update(values, v, offset, axes=(2,))
        if n_keys < keys.shape[2]:
            k_seen, v_seen = keys[:, :, :n_keys], values[:, :, :n_keys]
        else:
            k_seen, v_seen = keys, values
        o = mx.fast.scaled_dot_product_attention(q, k_seen, v_seen, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(b, t, -1)
        return self.o_proj.matmul(o), keys, values


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

    def __call__(
        self, x: mx.array, offset: mx.array, mask: mx.array, keys: mx.array, values: mx.array, n_keys: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        r, keys, values = self.self_attn(
            mx.fast.rms_norm(x, self.input_layernorm, self.eps), offset, mask, keys, values, n_keys
        )
        h = x + r
        out = h + self.mlp(mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps))
        return out, keys, values


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
        self,
        x: mx.array,
        offset: mx.array,
        keys: list[mx.array],
        values: list[mx.array],
        n_keys: int,
        last_only: bool = True,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """``x``: token ids ``(T,)`` on the first shard, else hidden ``(T, hidden)``; ``offset``: the
        first position as int32 ``(1,)``. Attends over the first ``n_keys`` cache positions.
        Returns hidden ``(T, hidden)`` or logits (``(1, vocab)`` with ``last_only``, else
        ``(T, vocab)``) and the updated caches."""
        h = self.embed_tokens.rows(x) if self.embed_tokens is not None else x
        h = h[None]
        t = h.shape[1]
        positions = offset + mx.arange(t, dtype=mx.int32)
        mask = mx.arange(n_keys, dtype=mx.int32)[None, :] <= positions[:, None]
        new_keys, new_values = [], []
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            h, k, v = layer(h, offset, mask, k, v, n_keys)
            new_keys.append(k)
            new_values.append(v)
        h = h[0]
        if self.lm_head is not None:
            if last_only:
                h = h[-1:]
            h = self.lm_head.matmul(mx.fast.rms_norm(h, self.norm, self.config.rms_eps))
        return h, new_keys, new_values
