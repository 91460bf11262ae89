"""KV moves: a plan change carries every in-flight request's caches from the old ring's shards to
the new ones (or, where nodes short of memory swap their shards, holds them here through the swap);
a cache that cannot move is rebuilt from its tokens.

A part of :class:`~exo_tui.cluster.coordinator.Coordinator` (through
:class:`~exo_tui.cluster.switching.PlanSwitching`, which calls :meth:`KVMoves._move_kv`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from backends.base import KVCache
from exo_tui.cluster.parts import CoordinatorParts
from exo_tui.net.codec import call, call_frame
from exo_tui.net.errors import RemoteError
from exo_tui.net.messages import KV, Done, KVExport, KVImport
from exo_tui.net.protocol import HostError, PlanEntry, RingPlan, kv_from_array, kv_shape, kv_to_array

log = logging.getLogger("exo_tui.cluster")

KV_HOLD_BYTES = 1 << 30  # in-flight caches the coordinator holds while short nodes swap their shards


class KVMoves(CoordinatorParts):
    """In-flight requests' caches moved across a plan change (a part of the Coordinator)."""

    async def _move_kv(self, old: RingPlan, new: RingPlan, swap: Callable[[], Awaitable[None]] | None = None) -> None:
        """Move every in-flight request's caches from the old ring's shards to the new ones, a
        request at a time. With ``swap`` (nodes short of memory swap their shards), every cache is
        read first and held here (up to ``KV_HOLD_BYTES``; the others are rebuilt from their
        tokens), then ``swap`` runs, then the caches are written."""
        held: list[tuple[str, int, list[tuple[PlanEntry, KVCache]]]] = []
        held_bytes = 0
        for rid in self.pipeline.in_flight():
            cached = self.pipeline.cached(rid)
            if cached is None or cached[0] != old.version:
                continue
            try:
                moved = await self._export_kv(rid, old, new, cached[1])
                if swap is None:
                    await self._import_kv(rid, new, moved)
            except (RemoteError, ConnectionError, TimeoutError, KeyError, ValueError, HostError) as exc:
                log.info("KV of %s not moved (%s): it will be rebuilt from its tokens", rid, exc)
                continue
            if swap is None:
                self.pipeline.set_cached(rid, new.version, cached[1])
                continue
            nbytes = sum(k.nbytes + v.nbytes for _, c in moved for k, v in zip(c.keys, c.values, strict=True))
            if held_bytes + nbytes > KV_HOLD_BYTES:
                log.info("KV of %s not held through the swap (%d MB held already): it will be rebuilt from its tokens",
                         rid, held_bytes >> 20)
                continue
            held.append((rid, cached[1], moved))
            held_bytes += nbytes
        if swap is None:
            return
        await swap()
        for rid, n, moved in held:
            try:
                await self._import_kv(rid, new, moved)
            except (RemoteError, ConnectionError, TimeoutError, KeyError, ValueError, HostError) as exc:
                log.info("KV of %s not moved (%s): it will be rebuilt from its tokens", rid, exc)
                continue
            self.pipeline.set_cached(rid, new.version, n)

    async def _export_kv(self, rid: str, old: RingPlan, new: RingPlan, length: int) -> list[tuple[PlanEntry, KVCache]]:
        """Request ``rid``'s caches for each shard of ``new`` that is not already where it was: its
        first ``length`` positions, what its tokens so far fill (a verify step's rejected drafts
        stay behind). Every part is asked for at once (the pause lasts the slowest, not the sum:
        a drain of the middle of three nodes reads four parts)."""
        wanted = [e for e in new.ring
                  if not any(o.node_id == e.node_id and (o.start, o.end) == (e.start, e.end) for o in old.ring)]
        # the same shard on the same node keeps its cache

        async def part(o: PlanEntry, a: int, b: int) -> KVCache:
            kv, frame = await call_frame(self.connection(o.node_id), KVExport(rid, a, b, old.model, length), KV,
                                         timeout=30)
            return kv_from_array(a, b, np.asarray(frame.tensor), kv.length, kv.held)

        asks = [[(o, max(o.start, e.start), min(o.end, e.end)) for o in old.ring if max(o.start, e.start) < min(o.end, e.end)]
                for e in wanted]
        got = iter(await asyncio.gather(*(part(*ask) for parts in asks for ask in parts)))
        return [(e, _concat_kv([next(got) for _ in parts])) for e, parts in zip(wanted, asks, strict=True)]

    async def _import_kv(self, rid: str, new: RingPlan, moved: list[tuple[PlanEntry, KVCache]]) -> None:
        async def write(e: PlanEntry, cache: KVCache) -> None:
            length, held = kv_shape(cache)
            await call(self.connection(e.node_id), KVImport(rid, e.start, e.end, length, held, new.model), Done,
                       tensor=kv_to_array(cache), timeout=30)

        await asyncio.gather(*(write(e, cache) for e, cache in moved))


def _concat_kv(parts: list[KVCache]) -> KVCache:
    parts = sorted(parts, key=lambda c: c.start)
    keys = [k for p in parts for k in p.keys]
    values = [v for p in parts for v in p.values]
    return KVCache(parts[0].start, parts[-1].end, parts[0].length, keys, values)
