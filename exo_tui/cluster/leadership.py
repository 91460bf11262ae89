"""What a change of leader does: the leader runs the coordinator; a standby runs none.

:class:`Leadership` watches :class:`~exo_tui.cluster.consensus.CoordinatorSet`. When this process
becomes leader it first commits a ``took_charge`` entry of its term (once it is committed, this
coordinator has applied everything an earlier leader committed), then starts a
:class:`~exo_tui.cluster.coordinator.Coordinator` on the replicated state, as a restarted
coordinator starts on its state file: it connects to the known nodes, attaching with its term
(a node then refuses the commands of any older term: fencing), restores pins and drains, and
re-adopts the plan in force, whose shards and KV caches the nodes still hold: nothing reloads.
When it stops leading (a new leader elsewhere, or its lease ran out without a majority), it stops
driving the nodes at once and drops its coordinator; the next leadership builds a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from exo_tui.cluster.consensus import CoordinatorSet
from exo_tui.cluster.replicated_state import NotAcknowledged, ReplicatedStore
from exo_tui.discovery.join import STORE_NAME, TokenStore

log = logging.getLogger("exo_tui.cluster.leadership")

POLL_S = 0.05
TOKENS_POLL_S = 1.0


class Leadership:
    def __init__(self, cset: CoordinatorSet, make: Callable[[ReplicatedStore, int], Any],
                 on_change: Callable[[Any], Awaitable[None]] | None = None) -> None:
        """``make(store, term)`` builds a (not started) coordinator; ``on_change(coordinator or
        None)`` is told when this process starts or stops leading (the API swaps its app)."""
        self.cset = cset
        self.make = make
        self.on_change = on_change
        self.coordinator: Any = None
        self.store: ReplicatedStore | None = None
        self.term = 0
        self.in_charge = asyncio.Event()  # set while a started coordinator leads
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._tokens: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.cset.bind_loop(asyncio.get_running_loop())
        self._task = asyncio.create_task(self._run(), name="leadership")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self.cset.changed.wait()
            self.cset.changed.clear()
            try:
                if self.cset.is_leader and self.coordinator is None:
                    await self._take_charge()
                elif self.coordinator is not None and (not self.cset.is_leader or self.cset.term != self.term):
                    await self._step_down("a newer term leads" if self.cset.term != self.term else "it lost its lease")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged; the loop goes on and tries again
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("leadership change failed")
                await self._step_down(f"its start failed ({exc})")
                await asyncio.sleep(1.0)

    async def _take_charge(self) -> None:
        term, began = self.cset.term, time.monotonic()
        try:
            # Committed in this term: everything earlier leaders committed is applied here now.
            await self.cset.submit(self.cset.state.took_charge, term, self.cset.address, time.time())
        except NotAcknowledged as exc:
            log.warning("elected in term %d but could not commit: %s", term, exc)
            return
        if not self.cset.is_leader or self.cset.term != term:
            return
        self.term = term
        self.store = ReplicatedStore(self.cset.state, asyncio.get_running_loop())
        coordinator = self.make(self.store, term)
        self.coordinator = coordinator
        coordinator._notice("info", f"coordinator {self.cset.name or self.cset.address} leads in term {term}: "
                                    "adopting the nodes and the plan in force")
        await coordinator.start()
        if self.cset.state.model != (coordinator.model_name or ""):
            self.store.save_model(coordinator.model_name or "")
        log.info("leading in term %d: in charge %.2f s after the election", term, time.monotonic() - began)
        coordinator._notice("info", f"coordinator {self.cset.name or self.cset.address} is in charge (term {term}, "
                                    f"{time.monotonic() - began:.2f} s after its election)")
        self.in_charge.set()
        if self.on_change is not None:
            await self.on_change(coordinator)
        self._tokens = asyncio.create_task(self._share_join_tokens(coordinator.home), name="join-token records")

    async def _share_join_tokens(self, home: Path) -> None:
        """The join tokens' records (hashes) are replicated state: the new leader takes in those of
        earlier leaders (a token made on another coordinator's machine works here), then
        replicates its own as they change (``exo-tui join-token`` writes them to its file)."""
        tokens = TokenStore(home / STORE_NAME)
        await asyncio.to_thread(tokens.merge, dict(self.cset.state.join_tokens))
        while self.store is not None:
            records = await asyncio.to_thread(tokens.records)
            if records != self.cset.state.join_tokens:
                self.store.save_join_tokens(records)
            await asyncio.sleep(TOKENS_POLL_S)

    async def _step_down(self, why: str) -> None:
        coordinator, self.coordinator = self.coordinator, None
        self.in_charge.clear()
        if self._tokens is not None:
            self._tokens.cancel()
            self._tokens = None
        if coordinator is None:
            return
        log.warning("stepping down from term %d: %s", self.term, why)
        if self.on_change is not None:
            await self.on_change(None)
        with contextlib.suppress(Exception):
            await coordinator.stop(release=False)
        if self.store is not None:
            self.store.close()
            self.store = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._tokens is not None:
            self._tokens.cancel()
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            with contextlib.suppress(Exception):
                await coordinator.stop()
        self.cset.close()
