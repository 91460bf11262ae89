"""The decoder's layers in MLX, in the shape of mlx-lm's ``models/llama.py``: Attention, MLP,
TransformerBlock and the shard's model, float32 throughout, quantized matrices kept quantized; a
mixture of experts' layer has :class:`~backends.mlx.experts.SwitchGLU` for its MLP.
Every family is this llama with some of :class:`~backends.base.ModelConfig`'s switches on (q/k/v
biases, per-head q/k norms, post norms, tanh GELU, an attention scale, sliding windows, an
embedding scale, a logit soft-cap); a switch that is off adds no op.

Rotary angles are computed on the host in float64 (:func:`backends.rope.angles`, per layer: a
windowed gemma3 layer has its own base) and handed in as float32 cos/sin, like the NumPy
reference: ``mx.fast.rope`` computes them in float32, which is off by ~1e-3 at position 8000, and
on MLX's CPU build it is a dozen small ops anyway.

The KV cache of a request is a preallocated buffer per layer, ``(1, n_kv_heads, capacity,
head_dim)``; new keys and values are written into it at their position (``mx.slice_update``, which
MLX does in place when the old buffer has no other owner). A query at position ``p`` sees the keys
at positions ``<= p`` (and, on a windowed layer, ``> p - window``), which is both the causal mask
and the mask that hides the unused tail of the buffer, so a decode step can attend over the whole
buffer and keep fixed shapes (what lets ``mx.compile`` reuse one trace for every decode step).

A windowed layer's buffer is a ring of at most ``size`` positions instead (the window and the
positions a verify step may drop: ``ModelConfig.ring_rows``; mlx-lm's ``RotatingKVCache``;
:mod:`backends.rings`): a decode step writes row ``p % size`` and sees the rows whose positions
are in its window; a prompt's chunk attends over the ring's rows and its own keys side by side,
masked by their positions, and the ring keeps the last of them (:class:`Ring`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends.base import BackendError, ModelConfig
from backends.mlx.experts import SwitchGLU
from backends.mlx.quant import MLXWeight, fuse_rows, to_mlx
from backends.rope import angles, table_key
from backends.weights import LayerWeights, ShardWeights

GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class Kinds:
    """A shard's layers grouped by what their step inputs differ in: rotary tables (a base, scaled
    or not: :func:`backends.rope.table_key`) and attention windows (0: all positions). A plain
    llama has one of each."""

    table_layers: tuple[int, ...]  # one layer of each distinct rotary table
    windows: tuple[int, ...]  # each distinct window, at least one
    table_of: tuple[int, ...]  # per layer of the shard: the index of its table
    window_of: tuple[int, ...]  # per layer of the shard: the index of its window
    rings: tuple[bool, ...] = ()  # per window: its layers' caches are rings (shorter than the context)

    @classmethod
    def of(cls, config: ModelConfig, layers: Sequence[int]) -> Kinds:
        keys = list(dict.fromkeys(table_key(config, i) for i in layers))
        windows = list(dict.fromkeys(config.window(i) for i in layers)) or [0]
        first = {key: next(i for i in layers if table_key(config, i) == key) for key in keys}
        return cls(
            table_layers=tuple(first[key] for key in keys),
            windows=tuple(windows),
            table_of=tuple(keys.index(table_key(config, i)) for i in layers),
            window_of=tuple(windows.index(config.window(i)) for i in layers),
            rings=tuple(bool(w) and w < config.context_length for w in windows),
        )


@dataclass(frozen=True)
class Ring:
    """How a windowed layer's ring takes one step: a decode writes its token at row ``offset``;
    a chunk of several (``gather`` given) attends over the ring's first ``old`` rows and its own
    keys, and the ring becomes ``take(those, gather)``: each row's position, the last kept."""

    offset: mx.array  # int32 (1,): the row a single token is written to
    old: int = 0  # a chunk: the ring's rows (positions) written before it
    gather: mx.array | None = None  # a chunk: int32 (ring rows,), each new row's source among old + new


@dataclass(frozen=True)
class Step:
    """What every layer needs to know about the new tokens of one forward; the masks and tables
    one per kind (:class:`Kinds`), a layer takes its own by index."""

    offset: mx.array  # int32 (1,): the first new position (where the cache is written)
    masks: tuple[mx.array, ...]  # bool (T, n_keys) per window: query i sees key j
    cos: tuple[mx.array, ...]  # float32 (T, 1, head_dim) per table: cos of each pair's angle, for both elements
    sin: tuple[mx.array, ...]  # float32 (T, 1, head_dim) per table: -sin for a pair's first element, +sin for its second
    n_keys: int  # attend over the first n_keys cache positions
    eager: bool = False  # run eagerly (a prompt's chunk, not a compiled decode step): layers may read values back
    rings: tuple[Ring | None, ...] = ()  # per window: its layers' rings (None: full-length caches)


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs of ``x`` ``(B, T, heads, head_dim)``:
    ``(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)``, as ``x * cos + swap_pairs(x) * sin`` with
    :class:`Step`'s ``cos``/``sin`` (broadcast over the heads)."""
    b, t, h, d = x.shape
    swapped = x.reshape(b, t, h, d // 2, 2)[..., ::-1].reshape(b, t, h, d)
    return x * cos + swapped * sin


def step_inputs(config: ModelConfig, start: int, t: int, n_keys: int, kinds: Kinds | None = None,
                capacity: int | None = None) -> Step:
    """The :class:`Step` of ``t`` new tokens at positions ``start ..``, attending over ``n_keys``
    cache positions, for the layer kinds ``kinds`` (default: the whole model's); ``capacity``: the
    full-length buffers' (default ``n_keys``), whose first ``ring_rows`` a windowed layer's ring has."""
    kinds = kinds or Kinds.of(config, range(config.n_layers))
    positions = np.arange(start, start + t)
    cos, sin = [], []
    for layer in kinds.table_layers:
        c, s = angles(config, layer, positions)  # float64 (T, head_dim / 2), magnitude included
        c, s = np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)
        s[:, 0::2] *= -1
        cos.append(mx.array(c[:, None, :].astype(np.float32)))
        sin.append(mx.array(s[:, None, :].astype(np.float32)))
    keys, queries = np.arange(n_keys)[None, :], positions[:, None]
    masks: list[mx.array] = []
    rings: list[Ring | None] = []
    for window, is_ring in zip(kinds.windows, kinds.rings, strict=True):
        if is_ring:
            size = config.ring_rows
            mask, ring = ring_inputs(window, size, start, t, min(size, capacity or n_keys))
            masks.append(mask)
            rings.append(ring)
            continue
        seen = keys <= queries
        if window:
            seen &= keys > queries - window
        masks.append(mx.array(seen))
        rings.append(None)
    return Step(mx.array(np.array([start], dtype=np.int32)), tuple(masks), tuple(cos), tuple(sin), n_keys,
                eager=True, rings=tuple(rings))


def ring_positions(end: int, size: int, rows: int) -> np.ndarray:
    """The position each of a ring's ``rows`` holds once positions ``.. end - 1`` are written
    (row r: the last position ``= r`` mod ``size``; negative: not written yet). A row whose
    position a cut back dropped is taken for the one ``size`` before it, which no query sees
    (``backends.rings``: a cut keeps the window before it)."""
    r = np.arange(rows)
    return (end - 1) - ((end - 1 - r) % size)


def ring_inputs(window: int, size: int, start: int, t: int, rows: int) -> tuple[mx.array, Ring]:
    """The mask and :class:`Ring` of ``t`` tokens at ``start ..`` on a ring of ``rows`` rows (at
    most ``size``; fewer while the request is shorter than it)."""
    queries = np.arange(start, start + t)[:, None]
    offset = Ring(mx.array(np.array([start % size], dtype=np.int32)))
    if t == 1:  # row p % size; the rows whose positions are in the window
        held = ring_positions(start + 1, size, rows)
        return mx.array(((held > start - window) & (held >= 0))[None, :]), offset
    old = min(start, size)
    held = np.concatenate([ring_positions(start, size, old), np.arange(start, start + t)])
    seen = (held[None, :] <= queries) & (held[None, :] > queries - window) & (held[None, :] >= 0)
    kept = ring_positions(start + t, size, rows)
    source = np.where(kept >= start, old + kept - start, np.maximum(kept, 0) % size)
    return mx.array(seen), Ring(offset.offset, old, mx.array(source.astype(np.int32)))


def vector(w: np.ndarray | None) -> mx.array | None:
    """A norm's weight as MLX float32 (``None`` stays ``None``: the feature is off)."""
    return None if w is None else mx.array(np.asarray(w, dtype=np.float32))


class Attention:
    """``table`` and ``window``: the indices of this layer's rotary table and mask in a :class:`Step`."""

    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1,
                 table: int = 0, window: int = 0) -> None:
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.query_scale
        self.eps = config.rms_eps
        self.table, self.window = table, window
        fused = fuse_rows([w.wq, w.wk, w.wv])
        # one matmul for q, k and v when they share a format, else three
        self.qkv_proj = to_mlx(fused, f"{name}.attn_qkv", n_parts) if fused is not None else None
        self.q_proj = None if fused is not None else to_mlx(w.wq, f"{name}.attn_q", n_parts)
        self.k_proj = None if fused is not None else to_mlx(w.wk, f"{name}.attn_k", n_parts)
        self.v_proj = None if fused is not None else to_mlx(w.wv, f"{name}.attn_v", n_parts)
        self.o_proj = to_mlx(w.wo, f"{name}.attn_output", n_parts)
        self.bias = [mx.array(np.asarray(b, dtype=np.float32)) for b in (w.bq, w.bk, w.bv)] if w.bq is not None else None
        self.qkv_bias = mx.concatenate(self.bias) if self.bias is not None else None
        self.q_norm, self.k_norm = vector(w.q_norm), vector(w.k_norm)

    def __call__(self, x: mx.array, step: Step, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        q, k, v = self.project(x, step.cos[self.table], step.sin[self.table])
        o, keys, values = self.attend(q, k, v, step, keys, values)
        return self.output(o), keys, values

    def decode_batch(
        self, x: mx.array, steps: list[Step], cos: list[mx.array], sin: list[mx.array],
        keys: list[mx.array], values: list[mx.array],
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """The new tokens of several requests, ``x`` ``(1, N, hidden)`` (each request's step its
        masks' rows of them, in order): one matmul for all, attention per request over its own
        cache and its own rows (``cos``/``sin``: the batch's, per table)."""
        q, k, v = self.project(x, cos[self.table], sin[self.table])
        outs, new_keys, new_values = [], [], []
        a = 0
        for step, ks, vs in zip(steps, keys, values, strict=True):
            b = a + step.masks[0].shape[0]
            o, ks, vs = self.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], step, ks, vs)
            outs.append(o)
            new_keys.append(ks)
            new_values.append(vs)
            a = b
        return self.output(mx.concatenate(outs, axis=2)), new_keys, new_values

    def project(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k (normed per head where the model does, then rotated) and v as ``(B, heads, T, head_dim)``."""
        b, t, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj.matmul(x)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            qkv = qkv.reshape(b, t, nh + 2 * nkv, hd)
            if self.q_norm is None:  # q and k heads rotated together
                qk = rope(qkv[:, :, : nh + nkv], cos, sin)
                return _heads_first(qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv :])
            q, k, v = qkv[:, :, :nh], qkv[:, :, nh : nh + nkv], qkv[:, :, nh + nkv :]
        else:
            if self.q_proj is None or self.k_proj is None or self.v_proj is None:
                raise BackendError("attention without its fused or its q, k and v projections")
            q, k, v = (p.matmul(x) for p in (self.q_proj, self.k_proj, self.v_proj))
            if self.bias is not None:
                q, k, v = q + self.bias[0], k + self.bias[1], v + self.bias[2]
            q, k, v = q.reshape(b, t, nh, hd), k.reshape(b, t, nkv, hd), v.reshape(b, t, nkv, hd)
        if self.q_norm is not None:
            q = mx.fast.rms_norm(q, self.q_norm, self.eps)
            k = mx.fast.rms_norm(k, self.k_norm, self.eps)
        return _heads_first(rope(q, cos, sin), rope(k, cos, sin), v)

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, step: Step, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Write k, v into the cache at ``step.offset`` and attend over its first ``step.n_keys``
        (a windowed layer's ring: see :class:`Ring`)."""
        mask = step.masks[self.window]
        ring = step.rings[self.window] if step.rings else None
        if ring is not None and ring.gather is not None:
            k_all = mx.concatenate([keys[:, :, : ring.old], k], axis=2)
            v_all = mx.concatenate([values[:, :, : ring.old], v], axis=2)
            o = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=self.scale, mask=mask)
            return o, mx.take(k_all, ring.gather, axis=2), mx.take(v_all, ring.gather, axis=2)
        offset = ring.offset if ring is not None else step.offset
        keys = mx.slice_update(keys, k, offset, axes=(2,))
        values = mx.slice_update(values, v, offset, axes=(2,))
        n_keys = mask.shape[-1]
        if n_keys < keys.shape[2]:
            k_seen, v_seen = keys[:, :, :n_keys], values[:, :, :n_keys]
        else:
            k_seen, v_seen = keys, values
        o = mx.fast.scaled_dot_product_attention(q, k_seen, v_seen, scale=self.scale, mask=mask)
        return o, keys, values

    def output(self, o: mx.array) -> mx.array:
        b, _, t, _ = o.shape
        return self.o_proj.matmul(o.transpose(0, 2, 1, 3).reshape(b, t, -1))


def _heads_first(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``(B, T, heads, head_dim)`` arrays as ``(B, heads, T, head_dim)``."""
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def gelu_tanh(x: mx.array) -> mx.array:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + mx.tanh(GELU_C * (x + 0.044715 * (x * x * x))))


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def activation(config: ModelConfig):
    return gelu_tanh if config.activation == "gelu_tanh" else silu


class MLP:
    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1) -> None:
        if w.w_gate is None or w.w_up is None or w.w_down is None:
            raise BackendError(f"{name} has neither experts nor its gate, up and down matrices")
        fused = fuse_rows([w.w_gate, w.w_up])
        self.gate_up_proj = to_mlx(fused, f"{name}.ffn_gate_up", n_parts) if fused is not None else None
        self.gate_proj = None if fused is not None else to_mlx(w.w_gate, f"{name}.ffn_gate", n_parts)
        self.up_proj = None if fused is not None else to_mlx(w.w_up, f"{name}.ffn_up", n_parts)
        self.down_proj = to_mlx(w.w_down, f"{name}.ffn_down", n_parts)
        self.intermediate = w.w_down.shape[1]
        self.act = activation(config)

    def arrays(self) -> list[mx.array]:
        return [a for p in (self.gate_up_proj, self.gate_proj, self.up_proj, self.down_proj) if p is not None
                for a in p.arrays()]

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up_proj is not None:
            gate, up = mx.split(self.gate_up_proj.matmul(x), [self.intermediate], axis=-1)
        elif self.gate_proj is not None and self.up_proj is not None:
            gate, up = self.gate_proj.matmul(x), self.up_proj.matmul(x)
        else:
            raise BackendError("an MLP without its gate and up projections")
        return self.down_proj.matmul(self.act(gate) * up)


class TransformerBlock:
    def __init__(self, config: ModelConfig, w: LayerWeights, name: str, n_parts: int = 1,
                 table: int = 0, window: int = 0) -> None:
        self.eps = config.rms_eps
        self.input_layernorm = mx.array(w.attn_norm, dtype=mx.float32)
        self.post_attention_layernorm = mx.array(w.ffn_norm, dtype=mx.float32)
        # gemma3's norms of the attention's and the MLP's outputs (None: not this family)
        self.attn_post_norm, self.ffn_post_norm = vector(w.attn_post_norm), vector(w.ffn_post_norm)
        self.self_attn = Attention(config, w, name, n_parts, table, window)
        # a mixture of experts' layer: the router and its experts in place of one MLP
        self.mlp = (SwitchGLU(config, w, name, n_parts, activation(config)) if config.n_experts
                    else MLP(config, w, name, n_parts))

    def __call__(self, x: mx.array, step: Step, keys: mx.array, values: mx.array) -> tuple[mx.array, ...]:
        r, keys, values = self.self_attn(mx.fast.rms_norm(x, self.input_layernorm, self.eps), step, keys, values)
        return self.feed_forward(x, r, step.eager), keys, values

    def decode_batch(
        self, x: mx.array, steps: list[Step], cos: list[mx.array], sin: list[mx.array],
        keys: list[mx.array], values: list[mx.array],
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        a = mx.fast.rms_norm(x, self.input_layernorm, self.eps)
        r, keys, values = self.self_attn.decode_batch(a, steps, cos, sin, keys, values)
        return self.feed_forward(x, r, steps[0].eager), keys, values

    def feed_forward(self, x: mx.array, r: mx.array, eager: bool = False) -> mx.array:
        """The residual adds around the attention's output ``r`` and the MLP (``eager``: :class:`Step`'s)."""
        if self.attn_post_norm is not None:
            r = mx.fast.rms_norm(r, self.attn_post_norm, self.eps)
        h = x + r
        m = mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps)
        f = self.mlp(m, eager) if isinstance(self.mlp, SwitchGLU) else self.mlp(m)
        if self.ffn_post_norm is not None:
            f = mx.fast.rms_norm(f, self.ffn_post_norm, self.eps)
        return h + f


class ShardModel:
    """Layers ``[start, end)``, with the token embedding on the first shard and the final norm and
    output head on the last one (the head reuses the embedding's arrays when they are tied)."""

    def __init__(self, config: ModelConfig, weights: ShardWeights, n_parts: int = 1) -> None:
        self.config = config
        self.kinds = Kinds.of(config, range(weights.start, weights.end))
        self.layers = []
        for i in range(len(weights.layers)):  # by index: an iterator would hold the last layer while it makes the next
            lw = weights.layers[i]
            self.layers.append(TransformerBlock(config, lw, f"blk.{weights.start + i}", n_parts,
                                                self.kinds.table_of[i], self.kinds.window_of[i]))
            if weights.disposable:  # its arrays are MLX's now (see ShardWeights.disposable)
                weights.layers[i] = None  # type: ignore[call-overload]  # its arrays are MLX's now: see ShardWeights
            del lw
        self.embed_tokens: MLXWeight | None = (
            to_mlx(weights.embed, "token_embd", n_parts) if weights.embed is not None else None
        )
        self.norm = mx.array(weights.norm, dtype=mx.float32) if weights.norm is not None else None
        self.lm_head: MLXWeight | None = None
        if weights.output is not None:
            tied = weights.output is weights.embed and self.embed_tokens is not None
            self.lm_head = self.embed_tokens if tied else to_mlx(weights.output, "output", n_parts)

    def embed(self, x: mx.array) -> mx.array:
        """Token ids' rows (times the model's embedding scale) on the first shard; hidden elsewhere."""
        if self.embed_tokens is None:
            return x
        h = self.embed_tokens.rows(x)
        return h * self.config.embed_scale if self.config.embed_scale != 1.0 else h

    def __call__(
        self, x: mx.array, step: Step, keys: list[mx.array], values: list[mx.array], last_only: bool = True,
        head: bool = True,
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """``x``: token ids ``(T,)`` on the first shard, else hidden ``(T, hidden)``. Returns hidden
        ``(T, hidden)`` or logits (``(1, vocab)`` with ``last_only``, else ``(T, vocab)``) and the
        updated caches; without ``head``, the last layer's hidden ``(T, hidden)`` (for :meth:`head`)."""
        h = self.embed(x)[None]
        new_keys, new_values = [], []
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            h, k, v = layer(h, step, k, v)
            new_keys.append(k)
            new_values.append(v)
        h = h[0]
        if not head:
            return h, new_keys, new_values
        if last_only and self.lm_head is not None:
            h = h[-1:]
        return self.head(h), new_keys, new_values

    def decode_batch(
        self, x: mx.array, steps: list[Step], keys: list[list[mx.array]], values: list[list[mx.array]]
    ) -> tuple[mx.array, list[list[mx.array]], list[list[mx.array]]]:
        """The new tokens of several requests, one step each (``x``: ``(N,)`` ids or ``(N, hidden)``,
        request r's step its masks' rows of them: one token for a decode step, a verify step's
        several), with ``keys[r][layer]``: one matmul per weight for the batch. Returns
        ``(N, hidden | vocab)``."""
        h = self.embed(x)[None]  # (1, N, hidden): the requests' rows one after another
        n_tables = len(steps[0].cos)
        cos = [mx.concatenate([s.cos[i] for s in steps]) for i in range(n_tables)]  # (N, 1, head_dim)
        sin = [mx.concatenate([s.sin[i] for s in steps]) for i in range(n_tables)]
        by_layer_k = [list(ks) for ks in zip(*keys, strict=True)]  # [layer][request]
        by_layer_v = [list(vs) for vs in zip(*values, strict=True)]
        for li, layer in enumerate(self.layers):
            h, by_layer_k[li], by_layer_v[li] = layer.decode_batch(h, steps, cos, sin, by_layer_k[li], by_layer_v[li])
        new_keys = [list(ks) for ks in zip(*by_layer_k, strict=True)] if self.layers else [[] for _ in steps]
        new_values = [list(vs) for vs in zip(*by_layer_v, strict=True)] if self.layers else [[] for _ in steps]
        return self.head(h[0]), new_keys, new_values

    def head(self, h: mx.array) -> mx.array:
        """Logits of hidden ``(T, hidden)`` on the last shard (soft-capped where the model does);
        the hidden itself elsewhere."""
        if self.lm_head is None:
            return h
        logits = self.lm_head.matmul(mx.fast.rms_norm(h, self.norm, self.config.rms_eps))
        cap = self.config.logit_softcap
        return cap * mx.tanh(logits / cap) if cap else logits
