"""Windowed layers' KV caches: rings of ``window + MAX_DRAFT`` positions (ONNX's kernel and MLX keep them so).

A windowed layer's query at position ``p`` sees the keys at ``p - window + 1 .. p`` only, so its
cache needs no more than the last ``window`` positions, however long a request gets (Gemma 3: five
layers of six). Such a layer's cache is a ring of ``size`` rows (:attr:`ModelConfig.ring_rows`: the
window and :data:`~backends.base.MAX_DRAFT` more): position ``p`` in row ``p % size``; until a
request reaches ``size`` positions a ring is an ordinary cache (row ``p`` holds ``p``). The rows
beyond the window are what lets a cache drop a speculative step's rejected positions
(``Shard.truncate_kv``): the window before the position it goes back to must still be there. On
ONNX (``backends/onnx/kernels/attention.c``) a shard's pool holds the rings beside its full-length
caches, ``(windowed layers, slots, n_kv_heads, size, head_dim)``; on MLX each request's windowed
layers have ring buffers (``backends/mlx/shard.py``).

A cache's rings hold the positions from :meth:`RingLayout.first_held` on: the last ``size`` written,
and none before what an import brought (a cache's ``floor``). Cutting a cache back to ``to`` keeps
the whole window before ``to`` (so that what it exports afterwards is whole): possible while
``first_held <= to - window``, else a BackendError says to drop it and run its tokens again.

Exported (:class:`~backends.base.KVCache`), a ring is its last ``min(length, window)`` positions,
oldest first; imported, any cache that holds at least those is taken (a full-length one too).
``GroupQueryAttention`` (ONNX without the kernel library) reads full-length caches only: there
windowed layers keep full-length caches, as every layer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.base import BackendError, ModelConfig


@dataclass(frozen=True)
class RingLayout:
    """Where each layer of a shard keeps its caches: ``full_of[i]`` its index among the pool's
    full-length arrays, or ``ring_of[i]`` among its rings (-1: not there)."""

    window: int  # the positions a windowed layer's query sees (0: no rings)
    full_of: tuple[int, ...]
    ring_of: tuple[int, ...]
    sees: tuple[int, ...] = ()  # per layer: the positions its queries see (0: all), ring or not
    size: int = 0  # the rings' rows: the window and the positions a verify step may drop

    @classmethod
    def of(cls, config: ModelConfig, start: int, end: int, rings: bool) -> RingLayout:
        """``rings``: the shard runs the kernel, which takes rings (else every layer is full)."""
        windowed = [rings and config.windowed(i) and config.sliding_window < config.context_length
                    for i in range(start, end)]
        full_of, ring_of, n_full, n_ring = [], [], 0, 0
        for w in windowed:
            full_of.append(-1 if w else n_full)
            ring_of.append(n_ring if w else -1)
            n_full, n_ring = n_full + (not w), n_ring + w
        sees = tuple(config.window(i) for i in range(start, end))
        return cls(config.sliding_window if n_ring else 0, tuple(full_of), tuple(ring_of), sees,
                   config.ring_rows if n_ring else 0)

    @property
    def n_full(self) -> int:
        return sum(i >= 0 for i in self.full_of)

    @property
    def n_ring(self) -> int:
        return sum(i >= 0 for i in self.ring_of)

    def rows(self, length: int) -> np.ndarray:
        """The ring rows of a cache of ``length`` positions' last ``min(length, window)``, oldest first."""
        return np.arange(max(0, length - self.window), length) % self.size

    def held(self, layer: int, length: int) -> int:
        """Positions shard layer ``layer`` holds of a cache of ``length``."""
        return min(length, self.window) if self.ring_of[layer] >= 0 else length

    def first_held(self, length: int, floor: int = 0) -> int:
        """The first position the rings of a cache of ``length`` positions still hold: the last
        ``size`` written, none before ``floor`` (where an import began them)."""
        return max(floor, length - self.size) if self.window else 0

    def can_truncate(self, length: int, to: int, floor: int = 0) -> bool:
        """Whether a cache of ``length`` positions (rings begun at ``floor``) cut back to ``to``
        still holds the window before ``to``: all the next query sees, and all an export takes."""
        return not self.window or to >= length or self.first_held(length, floor) <= max(0, to - self.window)

    def truncate_error(self, request_id: str, length: int, to: int, floor: int) -> BackendError:
        return BackendError(
            f"request {request_id}'s windowed layers hold positions {self.first_held(length, floor)} to {length - 1} "
            f"only: its cache cannot go back to {to}; drop it and run its tokens again"
        )

    def check_import(self, layer: int, length: int, keys: np.ndarray, values: np.ndarray, heads: int,
                     head_dim: int, first_layer: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The positions of an imported cache layer this shard keeps: the first one's position and
        their keys and values (a windowed layer's last ``min(length, window)``, which are all its
        next queries see, or as many more as were sent: a full-length cache keeps them), with an
        error that says what is wrong when the arrays do not fit."""
        need = min(length, self.sees[layer]) if self.sees[layer] else length
        shape_k, shape_v = np.shape(keys), np.shape(values)
        if not (len(shape_k) == 3 and shape_k == shape_v and shape_k[0] == heads and shape_k[2] == head_dim
                and need <= shape_k[1] <= length):
            held = f"the last {need} to {length}" if need < length else f"{length}"
            raise BackendError(
                f"cache layer {first_layer + layer} has keys {shape_k} / values {shape_v}, expected "
                f"({heads}, {held}, {head_dim}) (n_kv_heads, positions, head_dim)"
            )
        keep = self.held(layer, length) if self.ring_of[layer] >= 0 else shape_k[1]
        return length - keep, keys[:, shape_k[1] - keep:], values[:, shape_k[1] - keep:]
