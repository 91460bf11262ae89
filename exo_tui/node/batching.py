"""A node's batching policy, pure: how long a batch waits for the steps of other requests.

Nothing here reads a clock or sleeps: every decision takes ``now`` (seconds on the caller's
monotonic clock), so the rules are tested with made-up times. :class:`Batching` holds what the
node has seen (each request's visits per hop, the last arrival, a recent run's time) and answers
the questions of :mod:`exo_tui.node.executor`'s loop: how long the gather window is
(:meth:`Batching.window_s`), whether a step is due back (:meth:`Batching.due`), whether a request
is alone here (:meth:`Batching.alone`), and how long to wait before running what is queued
(:meth:`Batching.gather_wait`). :func:`decodes_first` splits a run's steps from the next run's,
and :func:`one_step_a_key` keeps a request's later steps at a hop for the runs after its first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

Key = tuple[str, int]  # (request id, hop)

# How long a batch may wait for steps of other requests due back here (see _gather): a quarter
# of a recent run's time, within these bounds. Measured on 2 cores: a coordinator sends the next
# steps of 16 requests within 0.1-4 ms (p90) of their tokens, and a 16-row run costs ~3 one-row
# runs, so waiting a few ms for the stragglers pays for itself many times over.
GATHER_MIN_S = 0.001
GATHER_MAX_S = 0.010
GATHER_FRACTION = 0.25
# When every node of the ring is on this machine (the plan reaches all of them on loopback) they
# share its cores, and requests whose steps are at different places of the ring gain nothing from
# running there at the same time: a batch then waits up to a whole run (at most 3 x GATHER_MAX_S)
# so that the groups merge. Measured, 3 local nodes on 2 cores, 8 streams started together:
# batches of 1-7 rows and 74 tok/s with the usual window, whole batches and 109 tok/s with this
# one. Nodes on separate machines keep the short window: there, groups at different hops run in
# parallel (pipelining), which beats merging them.
GATHER_FRACTION_SHARED = 1.0
GATHER_SHARED_SCALE = 3.0
VISITS_KEEP_S = 30.0  # a request not seen here for this long is no longer expected back
QUIET_S = 0.0005  # with other requests active, a batch waits until no step came for this long
ACTIVE_S = 1.0  # a request whose step left here counts as active this long, until its time away is known


@dataclass(frozen=True)
class GatherPolicy:
    """The numbers of the rules (the module's constants by default)."""

    min_s: float = GATHER_MIN_S
    max_s: float = GATHER_MAX_S
    fraction: float = GATHER_FRACTION
    fraction_shared: float = GATHER_FRACTION_SHARED
    shared_scale: float = GATHER_SHARED_SCALE
    quiet_s: float = QUIET_S
    active_s: float = ACTIVE_S
    visits_keep_s: float = VISITS_KEEP_S


class _Queued(Protocol):
    @property
    def prompt(self) -> bool: ...

    @property
    def key(self) -> Key: ...

    deferred: bool


S = TypeVar("S", bound=_Queued)


def decodes_first(steps: list[S]) -> tuple[list[S], list[S]]:
    """This run's steps and the next run's. While decode steps of running streams wait, prompts
    (steps of several positions that are not a verify step's: those decode) not deferred before
    go to the next run, so a burst of new requests does not hold every running stream for the
    length of their prompts. A prompt is deferred once: it waits at most one run."""
    now = [s for s in steps if not s.prompt or s.deferred]
    fresh = [s for s in steps if s.prompt and not s.deferred]
    if not fresh or not any(not s.prompt for s in now):  # nothing to defer, or no decode step waits
        return steps, []
    for s in fresh:
        s.deferred = True
    return now, fresh


def one_step_a_key(queued: list[S], run: list[S]) -> tuple[list[S], list[S]]:
    """Of ``run`` (steps taken from ``queued``, in its order), those that run now: a request's
    first step queued at each hop. A later step of the same request and hop (the coordinator
    sends a long prompt's chunks without waiting for each to come back) needs the caches the one
    before it fills, so it waits for the next run, as does everything after it in the queue of that
    key. Returns the steps that run and the queue left, in its order."""
    first: dict[Key, S] = {}
    for s in queued:
        first.setdefault(s.key, s)
    now = [s for s in run if first[s.key] is s]
    ran = {id(s) for s in now}
    return now, [s for s in queued if id(s) not in ran]


@dataclass
class Visit:
    """A request's steps at one hop here: when its last step left (``None`` while one is here)
    and how long it usually stays away (the rest of the ring) before its next step arrives."""

    seen_s: float
    left_s: float | None = None
    away_s: float | None = None

    def due_s(self) -> float | None:
        if self.left_s is None or self.away_s is None:
            return None
        return self.left_s + self.away_s


@dataclass
class Batching:
    """What a node knows for forming batches, and the rules. ``shared_cores``: the ring's nodes
    all run on this machine (its plan reaches every hop on loopback)."""

    policy: GatherPolicy = field(default_factory=GatherPolicy)
    shared_cores: bool = False
    visits: dict[Key, Visit] = field(default_factory=dict)
    last_arrival_s: float = 0.0
    run_s: float = 0.0  # recent time of one run (moving average), for the gather window
    busy_s: float = 0.0  # time spent running, in all

    def arrived(self, key: Key, now: float) -> None:
        self.last_arrival_s = now
        v = self.visits.get(key)
        if v is None:
            self.visits[key] = Visit(now)
            return
        if v.left_s is not None:
            gap = now - v.left_s
            v.away_s = gap if v.away_s is None else 0.5 * v.away_s + 0.5 * gap
        v.left_s = None
        v.seen_s = now

    def left(self, key: Key, now: float) -> None:
        v = self.visits.get(key)
        if v is not None:
            v.left_s = v.seen_s = now

    def forget(self, rid: str) -> None:
        """A request ended (or its caches were taken over): it is not expected back."""
        for key in [k for k in self.visits if k[0] == rid]:
            del self.visits[key]

    def prune(self, now: float) -> None:
        """Forget the requests not seen for ``visits_keep_s``."""
        stale = now - self.policy.visits_keep_s
        for key in [k for k, v in self.visits.items() if v.seen_s < stale]:
            del self.visits[key]

    def window_s(self) -> float:
        p = self.policy
        if self.shared_cores:
            return min(p.shared_scale * p.max_s, max(p.min_s, p.fraction_shared * self.run_s))
        return min(p.max_s, max(p.min_s, p.fraction * self.run_s))

    def ran(self, seconds: float) -> None:
        self.busy_s += seconds
        self.run_s = seconds if not self.run_s else 0.7 * self.run_s + 0.3 * seconds

    def due(self, now: float, until: float) -> bool:
        """Whether a step of a request away from here is expected back by ``until`` (one due a
        moment ago, up to a window, may still be on its way; one due earlier is not waited for)."""
        lo = now - self.window_s()
        for v in self.visits.values():
            t = v.due_s()
            if t is not None and lo <= t <= until:
                return True
        return False

    def alone(self, keys: Collection[Key], now: float) -> bool:
        """Whether no request but ``keys`` has a step here or is expected back (a request counts
        as gone after twice its usual time away, or ``active_s`` before it has one)."""
        for k, v in self.visits.items():
            if k in keys:
                continue
            if v.left_s is None:
                return False
            limit = 2 * v.away_s + self.window_s() if v.away_s is not None else self.policy.active_s
            if now - v.left_s < limit:
                return False
        return True

    def gather_wait(self, now: float, deadline: float, *, burst: bool, queued: Iterable[Key]) -> float | None:
        """How long to wait (at most until ``deadline``, the end of the window) for more steps
        before running what is queued; None: run now. Steps due back or announced by a sender
        (``burst``) are waited for until the deadline; otherwise, while other requests are active,
        until no step has arrived for ``quiet_s`` (steps sent one after another by a coordinator
        trickle in a few tenths of a millisecond apart)."""
        if now >= deadline:
            return None
        until = deadline
        if not (burst or self.due(now, deadline)):
            quiet = self.last_arrival_s + self.policy.quiet_s
            if now >= quiet or self.alone(set(queued), now):
                return None
            until = min(deadline, quiet)
        return until - now
