"""The room a memory-limited node has for shards, as the node itself counts it.

A node under ``--memory-limit`` refuses a load that would take its process past its runtime's
baseline plus the limit (:meth:`exo_tui.node.host.ShardHost._check_room`): what it holds besides
shards and caches (its runtime, grown since start by the benchmark, imports, arenas) comes out of
the limit. The coordinator plans with the growth the node's reports say
(:meth:`~exo_tui.cluster.switching.PlanSwitching.device_profiles`, the first from the attach
reply). One growth no report can show before a load: the node opening the model's file (its
metadata parsed, the tokenizer's vocabulary) — measured on the default model, 15 to 17 MB
between a node's attach and its first load's check.

A refusal carries the node's ``need_bytes`` and ``room_bytes``; :class:`RoomNotes` keeps what
they imply (the node's growth, and the part of it its report did not show, which every node that
has not opened the file yet will grow by too), the next plan counts it, and the coordinator plans
again (:data:`REPLANS_AFTER_REFUSAL` times at most). :func:`limit_needed` finds the least limit
under which the limited nodes could serve the model, for the one sentence an operator reads when
they cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeGuard

from exo_tui.cluster.node_handle import NodeHandle, held_bytes
from exo_tui.net.errors import RemoteError
from exo_tui.net.protocol import NoRoom
from exo_tui.node.kv_budget import RESERVE_MIN_BYTES

REPLANS_AFTER_REFUSAL = 3
LIMIT_STEP_BYTES = 10_000_000  # the hint's resolution: 0.01 GB


def is_refusal(exc: object) -> TypeGuard[RemoteError]:
    """A node refused a load for want of room under its memory limit."""
    return isinstance(exc, RemoteError) and exc.code == NoRoom.code


def reported_growth(handle: NodeHandle) -> int:
    """What ``handle``'s last report says its runtime grew by since its baseline, besides the
    shards it holds (0 before any report)."""
    kv = handle.metrics.get("kv") or {}
    if "runtime_bytes" not in kv:
        return 0
    shards = sum(held_bytes(s) for s in handle.shards)
    return max(0, int(kv["runtime_bytes"]) - shards - handle.profile.runtime_baseline_bytes)


@dataclass
class RoomNotes:
    """What refusals said of the nodes' room, for the plans after them."""

    floors: dict[str, int] = field(default_factory=dict)  # node id -> the growth its refusal implied
    opened: set[tuple[str, str]] = field(default_factory=set)  # (node id, model key): the node opened that file
    open_bytes: int = 0  # what opening a model's file grew a node by beyond its report, the most seen

    def refused(self, handle: NodeHandle, exc: RemoteError, model: str) -> None:
        """``handle`` refused a load of ``model`` (it had opened the file to check it)."""
        self.opened.add((handle.node_id, model))
        limit = handle.profile.memory_limit_bytes
        room = exc.detail.get("room_bytes")
        if not limit or not isinstance(room, int | float):
            return
        caches = int((handle.metrics.get("kv") or {}).get("used_bytes", 0))
        shards = sum(held_bytes(s) for s in handle.shards)
        # its room is baseline + limit - resident - RESERVE_MIN; resident: baseline + growth + shards + caches
        growth = int(limit - RESERVE_MIN_BYTES - room - shards - caches)
        self.floors[handle.node_id] = max(self.floors.get(handle.node_id, 0), growth)
        self.open_bytes = max(self.open_bytes, growth - reported_growth(handle))

    def loaded(self, node_id: str, model: str) -> None:
        """A load of ``model`` succeeded on ``node_id``: its reports count the file from now on."""
        self.opened.add((node_id, model))

    def attached(self, node_id: str, model: str, holds: bool) -> None:
        """``node_id`` (re)joined, holding shards of ``model`` or not (a restarted node opens the
        file again)."""
        if holds:
            self.opened.add((node_id, model))
        else:
            self.opened.discard((node_id, model))

    def growth(self, handle: NodeHandle, model: str) -> int:
        """The growth to plan ``handle`` with: its report's, plus opening ``model``'s file where it
        has not yet, at least what its own refusal said."""
        extra = 0 if (handle.node_id, model) in self.opened else self.open_bytes
        return max(reported_growth(handle) + extra, self.floors.get(handle.node_id, 0))


def limit_needed(fits: Callable[[int], bool], low_bytes: int, high_bytes: int) -> int | None:
    """The least memory limit (to :data:`LIMIT_STEP_BYTES`) in ``(low_bytes, high_bytes]`` under
    which ``fits`` (a plan exists with every limited node given that limit); None if not even
    ``high_bytes`` does."""
    step = LIMIT_STEP_BYTES
    lo, hi = max(0, low_bytes // step), -(-high_bytes // step)
    if not fits(hi * step):
        return None
    while hi - lo > 1:  # fits(hi * step), and lo * step is known not to (or is the floor)
        mid = (lo + hi) // 2
        if fits(mid * step):
            hi = mid
        else:
            lo = mid
    return hi * step
