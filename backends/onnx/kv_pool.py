"""An ONNX shard's KV caches: one pool of slots, one slot a request, grown in place of copies.

The pool holds arrays ``(layers, slots, n_kv_heads, capacity, head_dim)`` for keys and for values
(and a windowed layer's rings beside them: :mod:`backends.rings`), in the shard's cache precision.
:class:`KVPool` hands out slots (the lowest free one, so live requests stay packed; doubling the
slots when full), grows the capacity (a multiple of ``CAPACITY_STEP``, at least twice the last,
never past the model's context) with every request's positions copied into its slot of the new
arrays, and reads and writes a request's positions for export and import. The arrays are anonymous
memory maps: a page is resident only once a position in it is written. The shard
(:mod:`backends.onnx.shard`) binds the arrays to its session (``PoolArrays.bindings``, dropped
when the pool's arrays change) and serialises every call under its lock.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from backends.base import BackendError, KVCache, ModelConfig
from backends.rings import RingLayout

CAPACITY_STEP = 256  # pools hold multiples of this many positions
FIRST_SLOTS = 4  # slots of a new pool; it doubles when full


def _zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in an anonymous memory map: its pages come on first write, 4 KB at a time. (NumPy
    asks for huge pages for arrays this large, and a request's first positions in a new pool then
    fault in a 2 MB page per layer and head, zeroed, after the kernel compacts memory for it:
    moving a request to a larger pool stalled its stream 0.2-0.6 s, where this takes ~6 ms.)"""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, int(np.prod(shape))).reshape(shape)


def _release_layer(array: np.ndarray, layer: int) -> None:
    """Give the pages of ``array[layer]`` (an array of :func:`_zeroed`, copied elsewhere) back to
    the system; they read as zeros after. (The map is shared memory: MADV_REMOVE frees its pages,
    where MADV_DONTNEED would only unmap them from this process.)"""
    buf = array.base
    while buf is not None and not isinstance(buf, mmap.mmap):
        buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
    if buf is None or not hasattr(mmap, "MADV_REMOVE"):
        return
    size = array[layer].nbytes
    start = -(-layer * size // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the layer only
    end = (layer + 1) * size // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        buf.madvise(mmap.MADV_REMOVE, start, end - start)


@dataclass
class PoolArrays:
    """Slots of one capacity; ``owners[s]`` is the request in slot ``s`` or None."""

    capacity: int
    keys: np.ndarray  # (full-length layers, slots, n_kv_heads, capacity, head_dim)
    values: np.ndarray
    owners: list[str | None]
    ring_keys: np.ndarray  # (windowed layers, slots, n_kv_heads, ring rows, head_dim): backends/rings.py
    ring_values: np.ndarray
    bindings: dict[tuple[int, int], tuple[ort.IOBinding, list[ort.OrtValue]]] = field(default_factory=dict)

    def layer(self, rings: RingLayout, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard layer ``i``'s keys and values, ``(slots, n_kv_heads, positions, head_dim)``."""
        if rings.ring_of[i] >= 0:
            return self.ring_keys[rings.ring_of[i]], self.ring_values[rings.ring_of[i]]
        return self.keys[rings.full_of[i]], self.values[rings.full_of[i]]

    @property
    def slots(self) -> int:
        return len(self.owners)


@dataclass
class CacheEntry:
    """Where a request's cache lives and how many positions it holds."""

    pool: PoolArrays
    slot: int
    length: int
    floor: int = 0  # the rings hold no position before it (backends/rings.py: first_held)

    @property
    def capacity(self) -> int:
        return self.pool.capacity


class KVPool:
    """The caches of layers ``[start, end)`` of ``config``, by request (``caches``), in one
    ``PoolArrays`` (``pool``; None while no request holds a cache)."""

    def __init__(self, config: ModelConfig, start: int, end: int, rings: RingLayout, dtype: np.dtype) -> None:
        self.config, self.start, self.end = config, start, end
        self.rings = rings
        self.dtype = dtype
        self.pool: PoolArrays | None = None
        self.caches: dict[str, CacheEntry] = {}

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def length(self, request_id: str) -> int:
        entry = self.caches.get(request_id)
        return entry.length if entry is not None else 0

    def capacity_for(self, needed: int) -> int:
        """The pool for a cache of ``needed`` positions: one spare position (see
        :mod:`backends.onnx.shard`), rounded up to ``CAPACITY_STEP``, never past the model's context."""
        cap = -(-(needed + 1) // CAPACITY_STEP) * CAPACITY_STEP
        return max(1, min(cap, self.config.context_length))

    def _with_capacity(self, capacity: int) -> PoolArrays:
        """The pool, with at least ``capacity`` positions a slot: made, or grown (to at least
        twice its capacity) with every request in its slot."""
        pool = self.pool
        if pool is None:
            keys, values, ring_keys, ring_values = self._arrays(FIRST_SLOTS, capacity)
            pool = self.pool = PoolArrays(capacity, keys, values, [None] * FIRST_SLOTS, ring_keys, ring_values)
        elif pool.capacity < capacity:
            self._remake(pool, pool.slots, max(capacity, self.capacity_for(2 * pool.capacity)))
        return pool

    def _arrays(self, slots: int, capacity: int) -> tuple[np.ndarray, ...]:
        """Keys and values of the full-length layers, then the windowed layers' rings."""
        c = self.config
        shape = (self.rings.n_full, slots, c.n_kv_heads, capacity, c.head_dim)
        ring = (self.rings.n_ring, slots, c.n_kv_heads, self.rings.size, c.head_dim)
        return (_zeroed(shape, self.dtype), _zeroed(shape, self.dtype),
                _zeroed(ring, self.dtype), _zeroed(ring, self.dtype))

    def _remake(self, pool: PoolArrays, slots: int, capacity: int) -> None:
        """New arrays for ``pool``, of ``slots`` slots of ``capacity`` positions; each request's
        positions in use are copied (the rest of the new pages stay untouched)."""
        keys, values, ring_keys, ring_values = self._arrays(slots, capacity)
        entries = list(self.caches.values())  # every cache is in the one pool
        for new, old, ring in ((keys, pool.keys, False), (values, pool.values, False),
                               (ring_keys, pool.ring_keys, True), (ring_values, pool.ring_values, True)):
            for layer in range(old.shape[0]):
                for e in entries:
                    n = min(e.length, self.rings.size) if ring else e.length
                    new[layer, e.slot, :, :n] = old[layer, e.slot, :, :n]
                _release_layer(old, layer)  # so a growth holds one layer's caches twice, not every layer's
        pool.keys, pool.values, pool.capacity = keys, values, capacity
        pool.ring_keys, pool.ring_values = ring_keys, ring_values
        pool.owners += [None] * (slots - pool.slots)
        pool.bindings.clear()  # they point at the old arrays

    def _take_slot(self, pool: PoolArrays, request_id: str) -> int:
        """The lowest free slot of ``pool`` (so live requests stay packed), doubling it when full."""
        for slot, owner in enumerate(pool.owners):
            if owner is None:
                pool.owners[slot] = request_id
                return slot
        slot = pool.slots
        self._remake(pool, 2 * slot, pool.capacity)
        pool.owners[slot] = request_id
        return slot

    def release(self, request_id: str) -> None:
        entry = self.caches.pop(request_id, None)
        if entry is None:
            return
        pool = entry.pool
        pool.owners[entry.slot] = None
        if not any(pool.owners):
            self.pool = None  # its memory goes back; the next request makes a new one

    def with_room(self, request_id: str, needed: int) -> CacheEntry:
        """The request's entry, in a pool with room for ``needed`` positions."""
        pool = self._with_capacity(self.capacity_for(needed))
        entry = self.caches.get(request_id)
        if entry is None:
            entry = self.caches[request_id] = CacheEntry(pool, self._take_slot(pool, request_id), 0)
        return entry

    def export(self, request_id: str) -> KVCache:
        """A float32 copy of the request's cache (empty where it has none)."""
        c = self.config
        entry = self.caches.get(request_id)
        if entry is None:
            empty = np.zeros((c.n_kv_heads, 0, c.head_dim), np.float32)
            return KVCache(self.start, self.end, 0, [empty.copy() for _ in range(self.n_layers)],
                           [empty.copy() for _ in range(self.n_layers)])
        n, s, pool = entry.length, entry.slot, entry.pool
        keys, values = [], []
        for i in range(self.n_layers):  # a ring: its last positions, oldest first
            rows = self.rings.rows(n) if self.rings.ring_of[i] >= 0 else slice(0, n)
            layer_keys, layer_values = pool.layer(self.rings, i)
            keys.append(layer_keys[s][:, rows].astype(np.float32))
            values.append(layer_values[s][:, rows].astype(np.float32))
        return KVCache(self.start, self.end, n, keys, values)

    def checked(self, cache: KVCache) -> tuple[int, list[tuple[int, np.ndarray, np.ndarray]]]:
        """``cache``'s part for these layers, checked (it covers them, fits the context, each layer
        holds what it should): its length and each layer's first position held, keys and values,
        for :meth:`install`."""
        c = self.config
        if not (cache.start <= self.start and self.end <= cache.end):
            raise BackendError(
                f"cache of layers [{cache.start}, {cache.end}) does not cover this shard's [{self.start}, {self.end})"
            )
        part = cache.slice_layers(self.start, self.end)
        n = int(part.length)
        if n > c.context_length:
            raise BackendError(f"cache of {n} tokens exceeds the model's context of {c.context_length}")
        if len(part.keys) != self.n_layers or len(part.values) != self.n_layers:
            raise BackendError(f"cache has {len(part.keys)} key / {len(part.values)} value layers, expected {self.n_layers}")
        return n, [self.rings.check_import(i, n, k, v, c.n_kv_heads, c.head_dim, self.start)
                   for i, (k, v) in enumerate(zip(part.keys, part.values, strict=True))]

    def install(self, request_id: str, n: int, kept: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Replace the request's cache with :meth:`checked`'s ``n`` positions, ``kept``."""
        self.release(request_id)
        entry = self.with_room(request_id, n)
        for i, (first, k, v) in enumerate(kept):
            layer_keys, layer_values = entry.pool.layer(self.rings, i)
            rows = self.rings.rows(n) if self.rings.ring_of[i] >= 0 else slice(first, n)
            layer_keys[entry.slot][:, rows] = k
            layer_values[entry.slot][:, rows] = v
        entry.length, entry.floor = n, max(0, n - self.rings.window)

    def truncate(self, request_id: str, length: int) -> None:
        """Keep the first ``length`` positions of the request's cache (where the rings allow)."""
        entry = self.caches.get(request_id)
        if entry is not None:
            if length < 0:
                raise BackendError(f"cannot truncate a KV cache to {length} positions")
            if not self.rings.can_truncate(entry.length, int(length), entry.floor):
                raise self.rings.truncate_error(request_id, entry.length, int(length), entry.floor)
            entry.floor = self.rings.first_held(entry.length, entry.floor)
            entry.length = min(int(length), entry.length)

    def rename(self, old: str, new: str) -> None:
        """The slot of ``old`` changes owner: nothing is copied."""
        if new in self.caches:
            raise BackendError(f"request {new} already has a cache here")
        entry = self.caches.pop(old, None)
        if entry is None:
            raise BackendError(f"request {old} has no cache here to hand over")
        entry.pool.owners[entry.slot] = new
        self.caches[new] = entry

    def clear(self) -> None:
        self.caches.clear()
        self.pool = None
