"""Which cores a shard's step runs on.

A step runs on the thread that calls ``session.run`` plus ``threads - 1`` intra-op threads of ONNX
Runtime's pool. Left to the scheduler, the two land on the same core now and then (a woken
thread goes where its waker runs), and where several nodes share a machine the thread that
receives a hidden state wakes on whichever core is idle, so every hop crosses cores. Pinned, the
calling thread runs each step on the first allowed core and the pool's threads on the next ones,
one each (what ONNX Runtime itself does when it picks the thread count); co-located nodes then
hand each other hidden states on one core. Measured on 2 cores, three ONNX nodes on loopback
against one, the clusters taking turns: 0.90x the one-node decode rate pinned, 0.86x not.

Only the calling thread is pinned, and only for the length of a run: other threads of the
process (and threads it starts later) keep every core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CorePlan:
    """The core a step's calling thread runs on and one core per intra-op pool thread."""

    run_cpu: int
    pool_cpus: tuple[int, ...]

    @property
    def ort_affinities(self) -> str:
        """The value of ONNX Runtime's ``session.intra_op_thread_affinities``: one entry per pool
        thread, 1-based logical processor ids."""
        return ";".join(str(cpu + 1) for cpu in self.pool_cpus)

    def enter(self) -> set[int] | None:
        """Pin the calling thread to ``run_cpu``; returns the cores to give back (None: unchanged)."""
        before = os.sched_getaffinity(0)
        if before == {self.run_cpu}:
            return None
        try:
            os.sched_setaffinity(0, {self.run_cpu})
        except OSError:  # the core was taken away since (cgroups, taskset): run where we are
            return None
        return before

    @staticmethod
    def leave(before: set[int] | None) -> None:
        if before is not None:
            os.sched_setaffinity(0, before)


def core_plan(threads: int, allowed: set[int] | None = None) -> CorePlan | None:
    """Cores for a step of ``threads`` threads within ``allowed`` (default: this process's
    cores), or None where pinning does not apply: one thread (nothing to keep apart), more threads
    than cores, or a platform without thread affinity (macOS)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads < 2 or threads > len(cpus):
        return None
    return CorePlan(cpus[0], tuple(cpus[1:threads]))
