"""What nodes and the coordinator send each other besides frames: the ring plan and KV caches.

The coordinator builds a :class:`RingPlan` and sends it (a typed message, see
:mod:`exo_tui.net.messages`); each node checks it (:meth:`RingPlan.check`) and forwards hidden
states along it. A request's KV cache travels as one float32 array (:func:`kv_to_array` /
:func:`kv_from_array`) with its shape (:func:`kv_shape`) beside it in the frame's body. These types sit below both sides so neither
imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.base import KVCache
from exo_tui.net.address import is_loopback
from exo_tui.net.codec import Message

FILLED = -1
"""The token of a step that fills a prompt's chunk (its ``fill`` body): the last hop draws none. A
long prompt goes through the ring in such steps, each of the rows a node's ``prefill_rows`` holds,
the last one drawing the first token."""

DRAFT_TAG = "draft:"
"""The model tag of a draft model's weights streamed to a node (``draft:NAME``): its load goes to the
node's draft model (:mod:`exo_tui.node.drafting`), not among its shards, and draft steps name it
in place of a path the node cannot read."""

FILL_QUEUED = 2
"""A long prompt's chunks that may wait at a node while it runs another of the same request: the
coordinator keeps at most this many more in flight than the one running (one a node of the ring,
up to ``FILL_QUEUED + 1``), and a node sizes its chunks for them
(:func:`backends.memory.prefill_rows`)."""


class HostError(Exception):
    """A request this node cannot serve; the message says why and what to do. ``code`` is what
    the node's error frame carries (:class:`~exo_tui.net.errors.RemoteError`'s code), ``detail``
    the plain values the coordinator acts on (its ``detail``)."""

    code = "error"

    def __init__(self, message: str, *, detail: dict[str, int | float | str] | None = None) -> None:
        super().__init__(message)
        self.detail = dict(detail or {})


class NoRoom(HostError):
    """A load would take the node past its ``--memory-limit``: the coordinator frees the node's
    old shards first (a switch with a longer pause) or plans around it."""

    code = "no_room"


class ChunkChecksumError(HostError):
    """A chunk of weights arrived corrupted: the sender may send it again."""

    code = "chunk_checksum"


@dataclass(frozen=True, slots=True)
class PlanEntry(Message):
    node_id: str
    host: str
    port: int
    start: int
    end: int
    backend: str = ""


@dataclass(frozen=True, slots=True)
class RingPlan(Message):
    """The ring as a node sees it: which layers each hop runs and where to send hidden states.
    It travels as its :meth:`~exo_tui.net.codec.Message.to_body`; the node checks the ring's
    layers with :meth:`check` once it has decoded it."""

    version: int
    n_layers: int
    ring: tuple[PlanEntry, ...]
    model: str = ""  # the model whose shards it runs (their load's tag): two models' shards can be held at once

    def check(self) -> RingPlan:
        """The plan, once its hops are known to cover its layers in order, each exactly once."""
        expected = 0
        for e in self.ring:
            if e.start != expected or e.end <= e.start:
                raise HostError(f"plan {self.version} is not a contiguous ring of layers at hop {e}")
            expected = e.end
        if expected != self.n_layers:
            raise HostError(f"plan {self.version} covers {expected} of {self.n_layers} layers")
        return self

    def on_loopback(self) -> bool:
        """Whether every hop is reached on loopback: the ring's nodes share one machine's cores."""
        return all(is_loopback(e.host) for e in self.ring)


def kv_held(cache: KVCache) -> list[int]:
    """Positions each layer of a cache holds: ``length``, or a windowed layer's last ones."""
    return [int(np.shape(k)[1]) for k in cache.keys]


def kv_to_array(cache: KVCache) -> np.ndarray:
    """A cache as one float32 array for the wire: ``(2, layers, n_kv_heads, length, head_dim)``
    when every layer holds ``length`` positions, else (windowed layers hold their last ones only)
    the layers side by side along the positions, ``(2, n_kv_heads, sum of held, head_dim)``, with
    :func:`kv_shape`'s ``held`` saying how many each has."""
    if not cache.keys:
        return np.zeros((2, 0, 0, 0, 0), np.float32)
    if all(n == cache.length for n in kv_held(cache)):
        return np.stack([np.stack(cache.keys), np.stack(cache.values)]).astype(np.float32, copy=False)
    return np.stack([np.concatenate(cache.keys, axis=1), np.concatenate(cache.values, axis=1)]).astype(np.float32, copy=False)


def kv_shape(cache: KVCache) -> tuple[int, list[int] | None]:
    """What goes with :func:`kv_to_array`'s array in the frame's body (``length`` and ``held`` of
    :class:`~exo_tui.net.messages.KV`): the positions held, and each layer's where they differ."""
    held = kv_held(cache)
    return cache.length, (held if any(n != cache.length for n in held) else None)


def kv_from_array(start: int, end: int, array: np.ndarray, length: int | None = None,
                  held: list[int] | None = None) -> KVCache:
    """:func:`kv_to_array`'s inverse; ``length`` and ``held``: :func:`kv_shape`'s."""
    n_layers = end - start
    if held is None:
        if array.ndim != 5 or array.shape[0] != 2 or array.shape[1] != n_layers:
            raise HostError(f"KV array of shape {array.shape} does not fit layers [{start}, {end})")
        length = array.shape[3]
        return KVCache(start, end, length, [array[0, i] for i in range(n_layers)], [array[1, i] for i in range(n_layers)])
    if length is None or len(held) != n_layers or any(not 0 <= n <= length for n in held):
        raise HostError(f"KV fields length={length!r:.20} held={held!r:.80} do not describe layers [{start}, {end})")
    if array.ndim != 4 or array.shape[0] != 2 or array.shape[2] != sum(held):
        raise HostError(f"KV array of shape {array.shape} does not hold {sum(held)} positions of layers [{start}, {end})")
    bounds = np.cumsum([0, *held])
    keys = [array[0, :, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    values = [array[1, :, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return KVCache(start, end, length, keys, values)
