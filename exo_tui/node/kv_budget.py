"""A node's budget for KV caches: the bytes it may give them, and what its requests hold.

The budget is the memory the node's process may hold, less what it holds besides caches, less a
reserve:

- the memory is, with ``--memory-limit``, the runtime's own resident memory (Python, NumPy, the
  backend: its baseline, measured once at start before any shard) plus the limit: the limit is
  what the node gives to models (shards' weights, KV caches, a load's transients, a step's
  temporaries), and the process's resident memory stays under baseline + limit
  (:func:`process_budget_bytes`). Without a limit it is the memory the machine has available;
- what the process holds besides caches (the runtime, the shards' weights) is measured as its
  resident memory after every load and unload (settled), and again whenever no cache is held;
- the reserve covers a step's temporaries and a backend's cache pool growing (it copies the
  caches into larger arrays, a layer at a time): ``RESERVE_FRACTION`` of what is left beside the
  runtime as settled, at least ``RESERVE_MIN_BYTES``. Under a limit, a prompt runs in chunks whose
  temporaries fit ``STEP_SHARE`` of it.

What the runtime grows by after a load or unload comes out of the reserve first, and only what
exceeds the reserve out of the budget: ``budget = memory - settled runtime - max(reserve, growth)``.
That growth is where a step's temporaries and freed caches went: ONNX Runtime's arenas and the
allocator keep that memory for the next steps, which is what the reserve is for. Measured on
tests/integration/test_admission.py's burst (a budget of 59 MB, eight requests of 7.4 MB): seen
between two rounds of steps with no cache held, the runtime had grown 8 MB, and the next round
took the process to the same resident memory as the first at the same caches. A budget that
shrank by that growth refused steps of the requests that admission had already given its bytes.

Caches are counted in positions per request and shard, as steps run (a shard's :class:`ShardCost`:
its layers' K and V for one token in the backend's cache dtype, a windowed layer's for at most its
window's positions, which is all its ring holds). A step that would take the
caches past the budget is refused (:class:`BudgetExceeded`) before it runs; the coordinator's
admission (:mod:`exo_tui.cluster.admission`) keeps that from happening by admitting no more than
the ring's budgets hold. Pure and clock-free: the agent feeds it measurements.

A draft model on the node (:mod:`exo_tui.node.drafting`) keeps a cache for each stream it drafts
for (up to 16): they are counted here too, under :data:`DRAFT_KEY` at the draft's own cost a
position (:meth:`KVBudget.set_draft`), in the bytes used that admission reads, but not in the
ring's bytes a position. A draft step that would take the caches past the budget makes room by
dropping other streams' draft caches (least recently asked first), else runs no drafts.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RESERVE_MIN_BYTES = 48 << 20
RESERVE_FRACTION = 0.2
STEP_SHARE = 0.5
"""Of the reserve, what a step's temporaries in the backend may take: a node under a limit runs a
prompt in chunks that small (:func:`backends.memory.prefill_rows`), and the coordinator sends it
through the ring in steps no larger (the node reports its ``prefill_rows``). The rest is for what
a step moves whole: its hidden states received and sent, a few copies of ``rows x hidden``
floats (0.8 MB each for 96 rows at hidden 2048), and a cache pool's growth (it copies one layer's
caches at a time)."""

ShardKey = tuple[str, int, int]  # a shard of a model: (model tag, start, end)
DRAFT_KEY: ShardKey = ("draft model", 0, 0)  # where a stream's draft cache is counted


def process_budget_bytes(limit_bytes: int | None, baseline_bytes: int) -> int | None:
    """The resident memory a node's process may reach: its runtime's baseline (measured at start)
    plus ``--memory-limit``, the memory it gives to models; None without a limit."""
    return baseline_bytes + limit_bytes if limit_bytes else None


class BudgetExceeded(Exception):
    """A step would take this node's KV caches past its budget."""


def bytes_per_position(n_layers: int, n_kv_heads: int, head_dim: int, value_bytes: int) -> int:
    """Bytes one token's K and V take in ``n_layers`` layers."""
    return n_layers * 2 * n_kv_heads * head_dim * value_bytes


@dataclass(frozen=True)
class ShardCost:
    """The bytes a request's cache of ``n`` positions takes on a shard: ``per_position`` for each
    of them in its full-length layers, ``window_per_position`` for at most ``window`` of them in
    its windowed layers (rings: :mod:`backends.rings`)."""

    per_position: int
    window_per_position: int = 0
    window: int = 0

    def bytes(self, n: int) -> int:
        return self.per_position * n + self.window_per_position * min(n, self.window)

    @property
    def first_position(self) -> int:
        """The bytes of a request's first position (each of its first ``window`` costs this)."""
        return self.per_position + self.window_per_position


@dataclass
class KVBudget:
    limit_bytes: int | None  # --memory-limit, the memory given to models; None: the machine's available memory
    baseline_bytes: int = 0  # the runtime's own resident memory, measured at start before any shard
    runtime_bytes: int = 0  # resident memory besides caches (measured)
    settled_runtime_bytes: int | None = None  # runtime_bytes after the last load or unload (None: runtime_bytes)
    available_bytes: int = 0  # memory the machine has available (measured; used without a limit)
    per_position: dict[ShardKey, ShardCost] = field(default_factory=dict)
    positions: dict[str, dict[ShardKey, int]] = field(default_factory=dict)
    refused: int = 0  # steps refused for want of room
    draft_cost: ShardCost | None = None  # a position of a stream's draft cache (None: no draft model here)
    # Steps run on the node's worker thread, heartbeats on its event loop: one lock for both.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    # ------------------------------------------------------------------ measurements

    def observe(self, rss_bytes: int, available_bytes: int, *, settled: bool = False) -> None:
        """The process's resident memory and the machine's available memory now. After a load or
        unload (``settled``), or when no cache is held, the resident memory less the caches
        counted is the runtime's; the runtime's growth counts from the settled one (or from less,
        where the runtime shrank below it since)."""
        with self._lock:
            self.available_bytes = int(available_bytes)
            if settled or not self.positions:
                self.runtime_bytes = max(0, int(rss_bytes) - self.used_bytes)
                # the runtime as settled: measured after a load or unload, lower if it shrank since
                if settled or self.runtime_bytes < self._settled_runtime:
                    self.settled_runtime_bytes = self.runtime_bytes

    def set_shards(self, per_position: Mapping[ShardKey, ShardCost | int]) -> None:
        """The shards held now and the bytes a request's positions take on each (an int: that
        many each); requests' counts for shards no longer held go."""
        with self._lock:
            self._set_shards(per_position)

    def _set_shards(self, per_position: Mapping[ShardKey, ShardCost | int]) -> None:
        self.per_position = {k: c if isinstance(c, ShardCost) else ShardCost(int(c)) for k, c in per_position.items()}
        for rid in list(self.positions):
            kept = {k: n for k, n in self.positions[rid].items() if k in self.per_position or
                    (k == DRAFT_KEY and self.draft_cost is not None)}
            if kept:
                self.positions[rid] = kept
            else:
                del self.positions[rid]

    def set_draft(self, cost: ShardCost | None) -> None:
        """The draft model here takes ``cost`` a position of a stream's cache (None: none here;
        its streams' counts go)."""
        with self._lock:
            self.draft_cost = cost
            self._set_shards(self.per_position)

    def draft_held(self) -> dict[str, int]:
        """Each stream's positions in the draft model's cache, as counted."""
        with self._lock:
            return {rid: held[DRAFT_KEY] for rid, held in self.positions.items() if DRAFT_KEY in held}

    # ------------------------------------------------------------------ the budget

    @property
    def process_limit_bytes(self) -> int | None:
        """The resident memory the process may reach under its limit (None: no limit)."""
        return process_budget_bytes(self.limit_bytes, self.baseline_bytes)

    @property
    def memory_bytes(self) -> int:
        """What the process may hold in all (without a limit: what it holds plus what is free)."""
        if (limit := self.process_limit_bytes) is not None:
            return limit
        return self.runtime_bytes + self.used_bytes + self.available_bytes

    @property
    def _settled_runtime(self) -> int:
        return self.runtime_bytes if self.settled_runtime_bytes is None else self.settled_runtime_bytes

    @property
    def runtime_growth_bytes(self) -> int:
        """What the runtime grew by since the last load or unload (taken out of the reserve first)."""
        return max(0, self.runtime_bytes - self._settled_runtime)

    @property
    def reserve_bytes(self) -> int:
        """For a step's temporaries and the runtime's growth since the last load or unload."""
        room = max(0, self.memory_bytes - self._settled_runtime)
        return max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * room))

    @property
    def step_room_bytes(self) -> int | None:
        """What a step's temporaries in the backend may take under a limit (None: no limit)."""
        return int(STEP_SHARE * self.reserve_bytes) if self.limit_bytes else None

    @property
    def budget_bytes(self) -> int:
        """The bytes KV caches may take here in all: the runtime's growth since the last load or
        unload comes out of the reserve first."""
        return max(0, self.memory_bytes - self._settled_runtime - max(self.reserve_bytes, self.runtime_growth_bytes))

    @property
    def used_bytes(self) -> int:
        return sum(self._cost(k).bytes(n) for held in self.positions.values() for k, n in held.items())

    def _cost(self, key: ShardKey) -> ShardCost:
        if key == DRAFT_KEY:
            return self.draft_cost or ShardCost(0)
        return self.per_position.get(key, ShardCost(0))

    @property
    def draft_bytes(self) -> int:
        """What the draft model's caches take here."""
        return sum(self._cost(DRAFT_KEY).bytes(held.get(DRAFT_KEY, 0)) for held in self.positions.values())

    @property
    def ring_bytes_per_position(self) -> int:
        """Bytes one position of a request takes on this node (over all its shards) at most: its
        first ones' (a windowed layer's past its window cost nothing more)."""
        return sum(c.first_position for c in self.per_position.values())

    # ------------------------------------------------------------------ steps

    def check(self, growth: dict[tuple[str, ShardKey], int]) -> dict[str, str]:
        """The requests among ``growth`` (request and shard -> positions it will hold after the
        step) that must not run, with the reason: those whose new positions, counted in the order
        given, would take the caches past the budget. Nothing is recorded."""
        with self._lock:
            room = self.budget_bytes - self.used_bytes
            refused: dict[str, str] = {}
            for (rid, key), length in growth.items():
                cost = self._cost(key)
                extra = max(0, cost.bytes(length) - cost.bytes(self.positions.get(rid, {}).get(key, 0)))
                if extra > room:
                    refused[rid] = self.refusal(rid, extra)
                else:
                    room -= extra
            self.refused += len(refused)
            return refused

    def record(self, rid: str, key: ShardKey, length: int) -> None:
        """Request ``rid`` holds ``length`` positions on shard ``key`` now."""
        with self._lock:
            if length > 0:
                self.positions.setdefault(rid, {})[key] = length
                return
            held = self.positions.get(rid)
            if held is not None:
                held.pop(key, None)
                if not held:
                    del self.positions[rid]

    def held(self, rid: str, key: ShardKey) -> int:
        return self.positions.get(rid, {}).get(key, 0)

    def drop(self, rid: str) -> None:
        with self._lock:
            self.positions.pop(rid, None)

    def rename(self, old: str, new: str) -> None:
        with self._lock:  # the ring's caches are taken over; a draft cache stays its stream's
            held = self.positions.pop(old, None)
            if held is not None:
                draft = held.pop(DRAFT_KEY, None)
                if held:
                    self.positions[new] = held
                if draft is not None:
                    self.positions[old] = {DRAFT_KEY: draft}

    def refusal(self, rid: str, need_bytes: int) -> str:
        return (f"KV budget exceeded: request {rid} needs {need_bytes / 1e6:.1f} MB more of KV cache and this node has "
                f"{max(0, self.budget_bytes - self.used_bytes) / 1e6:.1f} MB of its {self.budget_bytes / 1e6:.1f} MB "
                f"left ({len(self.positions)} requests hold caches): the coordinator admits fewer requests at once, "
                "or give the node more memory (--memory-limit)")

    def report(self) -> dict[str, Any]:
        """What the heartbeat carries (the coordinator admits against it)."""
        with self._lock:
            return self._report()

    def _report(self) -> dict[str, Any]:
        return {
            "limit_bytes": self.limit_bytes or 0,
            "runtime_baseline_bytes": self.baseline_bytes,
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "runtime_bytes": self.runtime_bytes,
            "runtime_growth_bytes": self.runtime_growth_bytes,  # since the last load or unload, of the reserve
            "reserve_bytes": self.reserve_bytes,
            "bytes_per_position": self.ring_bytes_per_position,
            # windowed layers' rings: their bytes for a whole window, and the other layers' a position
            "window_bytes": sum(c.window_per_position * c.window for c in self.per_position.values()),
            "full_bytes_per_position": sum(c.per_position for c in self.per_position.values()),
            "requests": len(self.positions),
            "draft_bytes": self.draft_bytes,  # of used_bytes, the draft model's streams' caches
            "refused": self.refused,
        }


def shard_cost(n_kv_heads: int, head_dim: int, start: int, end: int, value_bytes: int, ring_layers: int = 0,
               window: int = 0) -> ShardCost:
    """:class:`ShardCost` of a shard of layers ``[start, end)`` of which ``ring_layers`` keep
    rings of ``window`` positions."""
    ring_layers = ring_layers if window else 0
    return ShardCost(bytes_per_position(end - start - ring_layers, n_kv_heads, head_dim, value_bytes),
                     bytes_per_position(ring_layers, n_kv_heads, head_dim, value_bytes), window if ring_layers else 0)
