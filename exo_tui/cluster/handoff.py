"""The hand-off's leases, a part of :class:`exo_tui.cluster.pipeline.RemotePipeline` (described
there): a plain decode step sent with ``ahead``, the steps the ring then runs on its own, and how
a lease's tokens are taken, and how it ends (its last step, an end-of-sequence token, a step from
elsewhere, a failure)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from exo_tui.cluster.ring_steps import Cached, Lease, PipelineHost, Result, Sent
from exo_tui.inference.request import Request
from exo_tui.net.timing import HopTiming


class Leases:
    """The pipeline's hand-off leases (a part of the RemotePipeline, which holds the state below)."""

    host: PipelineHost
    halt_on: Callable[[], frozenset[int]]
    _cached: dict[str, Cached]
    _leases: dict[str, Lease]
    _abandon: Callable[[Sent], None]  # the pipeline's: a sent step is no longer waited for
    # Handed steps given up while the ring may still run them: a verify step sent next takes the
    # first one's step, and the handed one's token (no verdict) must not pass for its reply
    _handed_gone: set[tuple[str, int, int]]

    def _lease_token(self, rid: str, lease: Lease, step: int, token: int, hops: tuple[HopTiming, ...] | None) -> None:
        """A lease's token came: the ring's caches hold its position, and it ran its next step
        from it (timed from here), unless it was the lease's last or one it halts on."""
        lease.cached = max(lease.cached, lease.n0 + step - lease.first)
        self._cached[rid] = Cached(lease.plan.version, lease.cached)
        nxt = lease.steps.get(step + 1)
        if step >= lease.last or token in self.halt_on() or nxt is None:
            self._close(lease, after=step)
        elif hops:
            nxt.times = (time.monotonic(), hops[-1].out_wall, None)

    def _close(self, lease: Lease, after: int = -1) -> None:
        """The ring runs no more steps of ``lease`` (those after step ``after`` are abandoned);
        its step in flight on the plan ends."""
        for step, sent in list(lease.steps.items()):
            if step > after and not sent.fut.done():
                self._abandon(sent)
                if sent.handed:
                    self._handed_gone.add(sent.key)
                del lease.steps[step]
        if lease.open:
            lease.open = False
            if lease.holds_step:
                lease.holds_step = False
                self.host.step_done()

    def _lease_failed(self, lease: Lease, fut: asyncio.Future[Result]) -> None:
        if lease.open and (fut.cancelled() or fut.exception() is not None):
            self._close(lease)

    def _leased(self, request: Request, drafts: bool = False) -> Sent | None:
        """The lease's step that gives the request its next token, if the ring ran (or runs) it;
        a lease the request has left (a step from elsewhere, a rebuild) is abandoned. ``drafts``:
        the request has drafts to run (its speculation found them worth a verify step again): the
        lease ends at this token (the steps whose token already came still give theirs), so its
        next step runs them rather than waiting for the lease's last."""
        lease = self._leases.get(request.id)
        if lease is None:
            return None
        k = len(request.generated)
        sent = lease.steps.get(k)
        if sent is not None and k > lease.taken and not sent.fut.cancelled() and request.n_tokens == lease.n0 + k - lease.first:
            lease.taken = k
            if drafts and lease.open:
                self._close(lease, after=k)
            if not lease.open and k == max(lease.steps):
                del self._leases[request.id]
            return sent
        self._drop_lease(request.id)
        return None

    def _drop_lease(self, rid: str) -> None:
        lease = self._leases.pop(rid, None)
        if lease is not None:
            self._close(lease)
            for sent in lease.steps.values():
                self._abandon(sent)
