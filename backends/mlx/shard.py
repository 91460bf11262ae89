"""The MLX backend: a :class:`~backends.base.Shard` over :class:`~backends.mlx.llama.ShardModel`
with one preallocated KV cache per request.

A decode step (one token) of the whole shard runs as one ``mx.compile``-d function (elementwise
ops fused, ~47 graph nodes per layer), traced once per thread and cache capacity (capacities grow
in steps of :data:`CACHE_STEP` positions, so retraces are rare); prefill (several tokens) runs
eagerly, its per-op cost shared by all its tokens. q/k/v and gate/up are one matmul each and the
cache is written in place. On MLX's CPU build the matmul kernels, not op dispatch, take the time
(single-threaded scalar loops), so each matmul is also cut into row blocks run at once on several
CPU streams (``threads``).

A windowed layer's buffer is a ring of at most its window's positions and the few a verify step
may drop (:mod:`backends.rings`), so a long request costs such a layer no more than that.

Several requests' decode steps go through :meth:`MLXShard.forward_batch` together (a verify
step's few rows among them: their requests' tokens one after another, run eagerly): one matmul
per weight for all of them (a mixture of experts' layer: one gathered product per kind of expert
matrix for all their rows, :mod:`backends.mlx.experts`; on the CPU such a batch runs eagerly, each
chosen expert once on its rows), attention per request over its own cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from backends.base import (
    FOLD_ROWS,
    BackendError,
    HeadRows,
    KVCache,
    ModelConfig,
    Shard,
    validate_forward_input,
)
from backends.mlx.experts import on_cpu
from backends.mlx.llama import Kinds, Ring, ShardModel, Step, step_inputs
from backends.mlx.quant import MLXWeight
from backends.rings import RingLayout
from backends.weights import ShardWeights

CACHE_STEP = 256
"""KV cache buffers grow by this many positions at a time."""


@dataclass
class RequestCache:
    """One request's KV buffers ``(1, n_kv_heads, capacity, head_dim)`` per layer (a windowed
    layer's: ``min(ring rows, capacity)`` rows, a ring)."""

    keys: list[mx.array]
    values: list[mx.array]
    length: int
    capacity: int = 1 << 62  # the full-length buffers' positions
    floor: int = 0  # the rings hold no position before it (backends/rings.py: first_held)


class MLXShard(Shard):
    def __init__(
        self, config: ModelConfig, weights: ShardWeights, *, compile_decode: bool = True, threads: int = 1
    ) -> None:
        super().__init__(config, weights.start, weights.end)
        if weights.end > config.n_layers or weights.start < 0:
            raise BackendError(
                f"layers [{weights.start}, {weights.end}) are outside the model's {config.n_layers} layers"
            )
        self.n_parts = matmul_parts(threads)
        self.model = ShardModel(config, weights, self.n_parts)
        if self.is_first and self.model.embed_tokens is None:
            raise BackendError(f"shard [{self.start}, {self.end}) starts at layer 0 but has no token embedding")
        if self.is_last and self.model.lm_head is None:
            raise BackendError(f"shard [{self.start}, {self.end}) ends the model but has no norm/output head")
        mx.eval(self._arrays())
        self.rings = RingLayout.of(config, self.start, self.end, rings=True)
        self._caches: dict[str, RequestCache] = {}
        self._lock = threading.RLock()
        self.compile_decode = compile_decode
        self._local = threading.local()  # MLX streams, and so compiled traces, belong to a thread

    # ------------------------------------------------------------------ running

    def _decode_step(
        self, x: mx.array, step: list[mx.array], keys: list[mx.array], values: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """One token through the shard, attending over the whole cache buffer (fixed shapes)."""
        return self.model(x, _step(step, self.model.kinds), keys, values)

    def _batch_step(
        self, x: mx.array, steps: list[list[mx.array]], keys: list[list[mx.array]], values: list[list[mx.array]]
    ) -> tuple[mx.array, list[list[mx.array]], list[list[mx.array]]]:
        """One token of each of several requests, each attending over its whole cache buffer."""
        return self.model.decode_batch(x, [_step(s, self.model.kinds) for s in steps], keys, values)

    def _step_inputs(self, start: int, t: int, n_keys: int, capacity: int | None = None) -> Step:
        return step_inputs(self.config, start, t, n_keys, self.model.kinds, capacity)

    def _compiled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled, once per thread (compiled traces hold the thread's MLX streams)."""
        if not self.compile_decode:
            return fn
        compiled = getattr(self._local, name, None)
        if compiled is None:
            compiled = mx.compile(fn)
            setattr(self._local, name, compiled)
        return compiled

    def _begin(self, request_id: str, x: np.ndarray, positions: np.ndarray) -> int:
        """Check one request's step (nothing changes when it is wrong); the tokens it has cached."""
        cache = self._caches.get(request_id)
        cached = cache.length if cache is not None else 0
        validate_forward_input(self, x, positions, cached)
        t = positions.shape[0]
        if not np.array_equal(positions, np.arange(cached, cached + t)):
            raise BackendError(
                f"positions must be consecutive from {cached}, got {positions[:8].tolist()}{'...' if t > 8 else ''}"
            )
        return cached

    def _cache_for(self, request_id: str, length: int) -> RequestCache:
        cache = self._caches.get(request_id)
        if cache is None:
            cache = self._caches[request_id] = self._empty_cache()
        self._reserve(cache, length)
        return cache

    def _inputs(self, x: np.ndarray) -> mx.array:
        return mx.array(x.astype(np.int32)) if self.is_first else mx.array(x.astype(np.float32, copy=False))

    def _decode_keys(self, cache: RequestCache) -> int:
        """Positions a decode step attends over: the whole buffer (masked), for fixed shapes."""
        return min(cache.capacity, self.config.context_length)

    def forward(
        self, request_id: str, x: np.ndarray, positions: np.ndarray, *, all_logits: bool = False
    ) -> np.ndarray:
        x = np.asarray(x)
        positions = np.asarray(positions)
        with self._lock:
            self._check_open()
            cached = self._begin(request_id, x, positions)
            t = positions.shape[0]
            cache = self._cache_for(request_id, cached + t)
            if t == 1:
                step = self._step_inputs(cached, 1, self._decode_keys(cache))
                out, keys, values = self._compiled("decode", self._decode_step)(
                    self._inputs(x), _flat(step), cache.keys, cache.values
                )
                # drop the old buffers before evaluating, so the cache update happens in place
                cache.keys, cache.values, cache.length = keys, values, cached + 1
                self._evaluate([request_id], out, keys, values)
                return np.array(out, dtype=np.float32)
            outs = []
            rows = self.prefill_chunk  # read once: a node may set it as a step runs
            for a in range(0, t, rows):  # chunks bound the (heads, T, keys) attention scores
                b = min(t, a + rows)
                step = self._step_inputs(cached + a, b - a, cached + b, cache.capacity)
                out, keys, values = self.model(
                    self._inputs(x[a:b]), step, cache.keys, cache.values, last_only=not all_logits
                )
                cache.keys, cache.values, cache.length = keys, values, cached + b
                self._evaluate([request_id], out, keys, values)
                if b == t or all_logits or not self.is_last:
                    outs.append(np.array(out, dtype=np.float32))
            return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def forward_rows(self, request_id: str, x: np.ndarray, positions: np.ndarray) -> HeadRows:
        """A verify step on the last shard: the layers now, the head on a row when its logits are
        asked for. On the CPU the head's cost grows with its rows (SmolLM2's: ~20 ms a row on one
        thread), so it runs a row at a time, and a check that rejects the first draft pays for one;
        on a GPU, whose head reads its weights in about the same time for a few rows as for one,
        all rows at once."""
        x, positions = np.asarray(x), np.asarray(positions)
        t = positions.shape[0]
        if not self.is_last or t < 2 or t > self.prefill_chunk:
            return super().forward_rows(request_id, x, positions)
        with self._lock:
            self._check_open()
            cached = self._begin(request_id, x, positions)
            cache = self._cache_for(request_id, cached + t)
            step = self._step_inputs(cached, t, cached + t, cache.capacity)
            hidden, keys, values = self.model(self._inputs(x), step, cache.keys, cache.values, head=False)
            cache.keys, cache.values, cache.length = keys, values, cached + t
            self._evaluate([request_id], hidden, keys, values)

        def head(a: int, b: int) -> np.ndarray:
            with self._lock:
                self._check_open()
                return np.array(self.model.head(hidden[a:b]), dtype=np.float32)

        return HeadRows(t, head, 1 if on_cpu() else t)

    @property
    def verifies_in_batch(self) -> bool:
        """On a GPU a verify step's rows join the batch (its head reads the weights once for all
        rows); on the CPU the head costs every row its own (~20 ms), so it runs alone, its head a
        row at a time (:meth:`forward_rows`)."""
        return not on_cpu()

    def _joins(self, t: int, all_logits: bool) -> bool:
        """Whether a step of ``t`` tokens runs in a batch (else alone): a decode step, or up to
        :data:`FOLD_ROWS` tokens (a verify step's), on the last shard where every row's logits are
        wanted."""
        return t == 1 or (t <= FOLD_ROWS and (all_logits or not self.is_last))

    def forward_batch(self, items: list[tuple[str, np.ndarray, np.ndarray]],
                      all_logits: Collection[int] = ()) -> list[np.ndarray]:
        """Steps of several requests run as one batch: each matmul runs once for all their rows,
        decode steps (one token each) as one compiled step, with a verify step's (a few tokens:
        :meth:`_joins`) eagerly; longer steps among them run alone. A bad item fails the whole call
        before any cache changes."""
        items = [(rid, np.asarray(x), np.asarray(p)) for rid, x, p in items]
        joins = [i for i, (_, _, p) in enumerate(items) if p.ndim == 1 and self._joins(p.shape[0], i in all_logits)]
        if len(joins) < 2 or len({r for r, _, _ in items}) < len(items):
            return super().forward_batch(items, all_logits)
        if len(joins) < len(items):  # those alone, the others batched
            with self._lock:
                for rid, x, p in items:  # every item checked before any cache changes
                    self._begin(rid, x, p)
                part = self.forward_batch([items[i] for i in joins], [n for n, i in enumerate(joins) if i in all_logits])
                batched = dict(zip(joins, part, strict=True))
                return [batched[i] if i in batched else self.forward(*items[i], all_logits=i in all_logits)
                        for i in range(len(items))]
        with self._lock:
            self._check_open()
            cached = [self._begin(rid, x, p) for rid, x, p in items]
            ts = [p.shape[0] for _, _, p in items]
            caches = [self._cache_for(rid, n + t) for (rid, _, _), n, t in zip(items, cached, ts, strict=True)]
            hidden = self._inputs(np.concatenate([x for _, x, _ in items]))
            keys_in, values_in = [c.keys for c in caches], [c.values for c in caches]
            if max(ts) > 1:  # a verify step's rows among them: eagerly, each request's step its tokens
                steps = [self._step_inputs(n, t, n + t, c.capacity) for n, t, c in zip(cached, ts, caches, strict=True)]
                ran, keys, values = self.model.decode_batch(hidden, steps, keys_in, values_in)
            elif self.config.n_experts and on_cpu():  # eager: each chosen expert once on its rows (backends.mlx.experts)
                steps = [self._step_inputs(n, 1, self._decode_keys(c)) for n, c in zip(cached, caches, strict=True)]
                ran, keys, values = self.model.decode_batch(hidden, steps, keys_in, values_in)
            else:
                steps = [self._step_inputs(n, 1, self._decode_keys(c)) for n, c in zip(cached, caches, strict=True)]
                ran, keys, values = self._compiled("decode_batch", self._batch_step)(
                    hidden, [_flat(s) for s in steps], keys_in, values_in,
                )
            for cache, n, t, ks, vs in zip(caches, cached, ts, keys, values, strict=True):
                cache.keys, cache.values, cache.length = ks, vs, n + t
            self._evaluate([rid for rid, _, _ in items], ran, keys, values)
            rows = np.array(ran, dtype=np.float32)
            ends = np.cumsum(ts)
            return [rows[b - t : b] for b, t in zip(ends, ts, strict=True)]

    def _evaluate(self, request_ids: list[str], *arrays: Any) -> None:
        """Run the step; when it fails, its requests' caches are half-written, so they are dropped
        (the coordinator rebuilds them from their tokens)."""
        try:
            mx.eval(*arrays)
        except Exception as exc:
            for rid in request_ids:
                self._caches.pop(rid, None)
            raise BackendError(f"MLX failed to run layers [{self.start}, {self.end}): {exc}") from exc

    def _check_open(self) -> None:
        if self.model is None:
            raise BackendError(f"shard [{self.start}, {self.end}) is closed: load it again")

    # ------------------------------------------------------------------ caches

    def _empty_cache(self) -> RequestCache:
        return RequestCache([], [], 0) if not self.model.layers else self._alloc(0)

    def _rows(self, layer: int, capacity: int) -> int:
        """Rows shard layer ``layer``'s buffer has in a cache of ``capacity`` positions."""
        return min(capacity, self.rings.size) if self.rings.ring_of[layer] >= 0 else capacity

    def _alloc(self, capacity: int) -> RequestCache:
        c = self.config
        shapes = [(1, c.n_kv_heads, self._rows(i, capacity), c.head_dim) for i in range(len(self.model.layers))]
        return RequestCache([mx.zeros(shape, mx.float32) for shape in shapes],
                            [mx.zeros(shape, mx.float32) for shape in shapes], 0, capacity)

    def _capacity_for(self, length: int) -> int:
        step = -(-length // CACHE_STEP) * CACHE_STEP
        return max(length, min(step, self.config.context_length))

    def _reserve(self, cache: RequestCache, length: int) -> None:
        """Grow the cache's buffers to hold ``length`` positions."""
        if not self.model.layers or length <= cache.capacity:
            return
        c = self.config
        capacity = self._capacity_for(length)

        def grown(buf: mx.array, layer: int) -> mx.array:
            extra = self._rows(layer, capacity) - buf.shape[2]
            if not extra:
                return buf
            return mx.concatenate([buf, mx.zeros((1, c.n_kv_heads, extra, c.head_dim), mx.float32)], axis=2)

        cache.keys = [grown(k, i) for i, k in enumerate(cache.keys)]
        cache.values = [grown(v, i) for i, v in enumerate(cache.values)]
        cache.capacity = capacity
        mx.eval(cache.keys, cache.values)

    @property
    def ring_layers(self) -> int:
        return self.rings.n_ring

    def kv_length(self, request_id: str) -> int:
        with self._lock:
            cache = self._caches.get(request_id)
            return cache.length if cache is not None else 0

    def export_kv(self, request_id: str) -> KVCache:
        with self._lock:
            cache = self._caches.get(request_id)
            if cache is None:
                n_layers = self.end - self.start
                return KVCache(self.start, self.end, 0, [self._zeros_np(0) for _ in range(n_layers)],
                               [self._zeros_np(0) for _ in range(n_layers)])
            n = cache.length
            rows = [self.rings.rows(n) if self.rings.ring_of[i] >= 0 else np.arange(n) for i in range(len(cache.keys))]
            keys = [np.array(k[0], dtype=np.float32)[:, r] for k, r in zip(cache.keys, rows, strict=True)]
            values = [np.array(v[0], dtype=np.float32)[:, r] for v, r in zip(cache.values, rows, strict=True)]
            return KVCache(self.start, self.end, n, keys, values)

    def _zeros_np(self, length: int) -> np.ndarray:
        return np.zeros((self.config.n_kv_heads, length, self.config.head_dim), np.float32)

    def import_kv(self, request_id: str, cache: KVCache) -> None:
        c = self.config
        if not (cache.start <= self.start and self.end <= cache.end):
            raise BackendError(
                f"a KV cache of layers [{cache.start}, {cache.end}) does not cover this shard's [{self.start}, {self.end})"
            )
        if len(cache.keys) != cache.end - cache.start or len(cache.values) != cache.end - cache.start:
            raise BackendError(
                f"a KV cache of layers [{cache.start}, {cache.end}) must hold {cache.end - cache.start} key and value "
                f"arrays, got {len(cache.keys)} and {len(cache.values)}"
            )
        if not 0 <= cache.length <= c.context_length:
            raise BackendError(f"KV cache length {cache.length} is outside 0..{c.context_length}")
        part = cache.slice_layers(self.start, self.end)
        n = cache.length
        kept = [self.rings.check_import(i, n, k, v, c.n_kv_heads, c.head_dim, self.start)
                for i, (k, v) in enumerate(zip(part.keys, part.values, strict=True))]
        with self._lock:
            self._check_open()
            self._caches.pop(request_id, None)
            capacity = self._capacity_for(n)
            new = self._alloc(capacity) if self.model.layers else RequestCache([], [], 0)
            if n:
                keys, values = [], []
                for i, (first, k, v) in enumerate(kept):
                    rows = self.rings.rows(n) if self.rings.ring_of[i] >= 0 else np.arange(first, n)
                    buf_k = np.zeros((c.n_kv_heads, self._rows(i, capacity), c.head_dim), np.float32)
                    buf_v = np.zeros_like(buf_k)
                    buf_k[:, rows], buf_v[:, rows] = k, v
                    keys.append(mx.array(buf_k)[None])
                    values.append(mx.array(buf_v)[None])
                new.keys, new.values = keys, values
            new.length, new.floor = n, max(0, n - self.rings.window)
            mx.eval(new.keys, new.values)
            self._caches[request_id] = new

    def truncate_kv(self, request_id: str, length: int) -> None:
        """Keep the first ``length`` positions: later ones are masked out and then overwritten."""
        if length < 0:
            raise BackendError(f"cannot truncate a KV cache to {length} positions")
        with self._lock:
            cache = self._caches.get(request_id)
            if cache is not None:
                if not self.rings.can_truncate(cache.length, length, cache.floor):
                    raise self.rings.truncate_error(request_id, cache.length, length, cache.floor)
                cache.floor = self.rings.first_held(cache.length, cache.floor)
                cache.length = min(cache.length, length)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._caches.pop(request_id, None)

    def rename_kv(self, old: str, new: str) -> None:
        with self._lock:
            if new in self._caches:
                raise BackendError(f"request {new} already has a cache here")
            cache = self._caches.pop(old, None)
            if cache is None:
                raise BackendError(f"request {old} has no cache here to hand over")
            self._caches[new] = cache

    def requests(self) -> list[str]:
        with self._lock:
            return list(self._caches)

    def close(self) -> None:
        with self._lock:
            self._caches.clear()
            self.model = None  # type: ignore[assignment]  # closed: its arrays go; nothing runs on it after
        mx.clear_cache()

    # ------------------------------------------------------------------ sizes

    def _arrays(self) -> list[mx.array]:
        out = []
        for layer in self.model.layers:
            attn = layer.self_attn
            out += [a for a in (layer.input_layernorm, layer.post_attention_layernorm, layer.attn_post_norm,
                                layer.ffn_post_norm, attn.qkv_bias, attn.q_norm, attn.k_norm) if a is not None]
            out += [b for b in attn.bias or [] if b is not None]
            for w in (layer.self_attn.qkv_proj, layer.self_attn.q_proj, layer.self_attn.k_proj,
                      layer.self_attn.v_proj, layer.self_attn.o_proj):
                out += _weight_arrays(w)
            out += layer.mlp.arrays()
        out += _weight_arrays(self.model.embed_tokens) + _weight_arrays(self.model.lm_head)
        if self.model.norm is not None:
            out.append(self.model.norm)
        return out


def _flat(step: Step) -> list[Any]:
    """A step's arrays as a compiled function takes them (arrays and lists of arrays)."""
    return [step.offset, list(step.masks), list(step.cos), list(step.sin),
            [ring.offset if ring is not None else step.offset for ring in step.rings]]


def _step(flat: list[Any], kinds: Kinds) -> Step:
    """:func:`_flat`'s inverse; a decode step attends over the whole buffer (its masks' width)."""
    offset, masks, cos, sin, offsets = flat
    rings = tuple(Ring(o) if ring else None for o, ring in zip(offsets, kinds.rings, strict=True))
    width = next((m.shape[1] for m, ring in zip(masks, kinds.rings, strict=True) if not ring), masks[0].shape[1])
    return Step(offset, tuple(masks), tuple(cos), tuple(sin), width, rings=rings)


def _weight_arrays(w: MLXWeight | None) -> list[mx.array]:
    return [] if w is None else w.arrays()


def matmul_parts(threads: int) -> int:
    """How many row blocks each matmul runs in: one per thread on the CPU, one on a GPU."""
    if threads < 1:
        raise BackendError(f"threads must be at least 1, got {threads}")
    return threads if mx.default_device().type == mx.DeviceType.cpu else 1
