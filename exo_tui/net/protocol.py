"""What nodes and the coordinator send each other besides frames: the ring plan and KV caches.

The coordinator builds a :class:`RingPlan` and sends it as a dict; each node checks it
(:meth:`RingPlan.from_dict`) and forwards hidden states along it. A request's KV cache travels as
one float32 array (:func:`kv_to_array` / :func:`kv_from_array`) and the fields of
:func:`kv_fields` beside it in the frame's body. These types sit below both sides so neither
imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import KVCache
from exo_tui.net.address import is_loopback

FILLED = -1
"""The token of a step that fills a prompt's chunk (its ``fill`` body): the last hop draws none. A
long prompt goes through the ring in such steps, each of the rows a node's ``prefill_rows`` holds,
the last one drawing the first token."""


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


@dataclass(frozen=True)
class PlanEntry:
    node_id: str
    host: str
    port: int
    start: int
    end: int
    backend: str = ""


@dataclass(frozen=True)
class RingPlan:
    """The ring as a node sees it: which layers each hop runs and where to send hidden states."""

    version: int
    n_layers: int
    ring: tuple[PlanEntry, ...]
    model: str = ""  # the model whose shards it runs (their load's tag): two models' shards can be held at once

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RingPlan:
        ring = tuple(PlanEntry(**e) for e in d["ring"])
        plan = cls(int(d["version"]), int(d["n_layers"]), ring, str(d.get("model", "")))
        expected = 0
        for e in ring:
            if e.start != expected or e.end <= e.start:
                raise HostError(f"plan {plan.version} is not a contiguous ring of layers at hop {e}")
            expected = e.end
        if expected != plan.n_layers:
            raise HostError(f"plan {plan.version} covers {expected} of {plan.n_layers} layers")
        return plan

    def on_loopback(self) -> bool:
        """Whether every hop is reached on loopback: the ring's nodes share one machine's cores."""
        return all(is_loopback(e.host) for e in self.ring)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "n_layers": self.n_layers,
            "ring": [e.__dict__ for e in self.ring],
            "model": self.model,
        }


def kv_held(cache: KVCache) -> list[int]:
    """Positions each layer of a cache holds: ``length``, or a windowed layer's last ones."""
    return [int(np.shape(k)[1]) for k in cache.keys]


def kv_to_array(cache: KVCache) -> np.ndarray:
    """A cache as one float32 array for the wire: ``(2, layers, n_kv_heads, length, head_dim)``
    when every layer holds ``length`` positions, else (windowed layers hold their last ones only)
    the layers side by side along the positions, ``(2, n_kv_heads, sum of held, head_dim)``, with
    :func:`kv_fields`' ``held`` saying how many each has."""
    if not cache.keys:
        return np.zeros((2, 0, 0, 0, 0), np.float32)
    if all(n == cache.length for n in kv_held(cache)):
        return np.stack([np.stack(cache.keys), np.stack(cache.values)]).astype(np.float32, copy=False)
    return np.stack([np.concatenate(cache.keys, axis=1), np.concatenate(cache.values, axis=1)]).astype(np.float32, copy=False)


def kv_fields(cache: KVCache) -> dict[str, Any]:
    """The frame body's fields that go with :func:`kv_to_array`'s array."""
    held = kv_held(cache)
    return {"length": cache.length, **({"held": held} if any(n != cache.length for n in held) else {})}


def kv_from_array(start: int, end: int, array: np.ndarray, fields: dict[str, Any] | None = None) -> KVCache:
    """:func:`kv_to_array`'s inverse; ``fields``: the frame body's (:func:`kv_fields`)."""
    fields = fields or {}
    held, n_layers = fields.get("held"), end - start
    if held is None:
        if array.ndim != 5 or array.shape[0] != 2 or array.shape[1] != n_layers:
            raise HostError(f"KV array of shape {array.shape} does not fit layers [{start}, {end})")
        length = array.shape[3]
        return KVCache(start, end, length, [array[0, i] for i in range(n_layers)], [array[1, i] for i in range(n_layers)])
    length = fields.get("length")
    if (type(length) is not int or type(held) is not list or len(held) != n_layers
            or any(type(n) is not int or not 0 <= n <= length for n in held)):
        raise HostError(f"KV fields length={length!r:.20} held={held!r:.80} do not describe layers [{start}, {end})")
    if array.ndim != 4 or array.shape[0] != 2 or array.shape[2] != sum(held):
        raise HostError(f"KV array of shape {array.shape} does not hold {sum(held)} positions of layers [{start}, {end})")
    bounds = np.cumsum([0, *held])
    keys = [array[0, :, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    values = [array[1, :, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return KVCache(start, end, length, keys, values)
