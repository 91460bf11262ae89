"""The node-wide budget of frame bytes being received: :class:`ReceiveBudget`.

Each frame's payload is counted from the moment its header is checked until the frame is
dispatched: handled, for an inline frame (a node's ``forward``); queued, or its call started, for
the others (their queues and call slots bound those). Every connection of one event loop (a node agent's coordinator, peers and
ring links) shares one budget (:func:`receive_budget`), so an authenticated peer sending 256 MiB
frames on many connections at once gets them read one budget's worth at a time: the others wait
(their sockets stop being read, TCP pushes back on the sender) instead of each taking its
memory. Waiters are served in arrival order; a frame larger than the whole budget waits until
nothing else is being received, so it cannot wait forever.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque

RECEIVE_BUDGET_BYTES = 512 << 20  # two frames at the default payload limit (256 MiB)


class ReceiveBudget:
    def __init__(self, capacity: int = RECEIVE_BUDGET_BYTES) -> None:
        if capacity <= 0:
            raise ValueError("a receive budget needs capacity > 0")
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _charge(self, nbytes: int) -> int:
        return min(nbytes, self.capacity)

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` fit; returns what to pass to :meth:`release`."""
        n = self._charge(nbytes)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise
        return n

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.used + n > self.capacity:
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReceiveBudget] = weakref.WeakKeyDictionary()


def receive_budget() -> ReceiveBudget:
    """The running loop's budget (made at first use, with :data:`RECEIVE_BUDGET_BYTES`)."""
    loop = asyncio.get_running_loop()
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets[loop] = ReceiveBudget(RECEIVE_BUDGET_BYTES)
    return budget
