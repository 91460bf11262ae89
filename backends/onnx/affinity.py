"""Which cores a shard's step runs on.

A step runs on the thread that calls ``session.run`` plus ``threads - 1`` intra-op threads of ONNX
Runtime's pool. Pinned, the calling thread runs each step on the first chosen core and the pool's
threads on the next ones, one each (ONNX Runtime pins its pool itself only when it picks the
thread count). The cores are chosen one logical CPU per physical core, the fastest first
(:func:`core_plan`). Left to the scheduler, a woken thread tends to go where its waker runs, so a pool
thread can land on the caller's core, and where several nodes share a machine each hop wakes the
next node on whichever core is idle.

It is a trade, so it is off unless asked for (``EXO_TUI_ONNX_PIN=1``). Measured on 2 cores, with
idle intra-op threads never spinning (``EXO_TUI_ONNX_SPIN=0``, then the default):

* Nodes handing steps to each other on one machine (``benchmarks/pipeline.py``,
  three ONNX node processes on loopback against one, one stream, the clusters taking turns):
  0.89-0.94x the one-node decode rate pinned against 0.83x not on uvloop, 0.89x against 0.82x
  on asyncio's loop. Pinning only the pool threads did not help; pinning only the calling
  thread slowed a lone node down.
* Nodes whose cores other work wants too (``benchmarks/api.py``, the coordinator and its HTTP
  server on the same 2 cores): one node, 8 streams batched, 118 tok/s pinned against 146 not;
  one stream 62 against 71; three nodes, 8 streams, 79 against 85. A pinned thread cannot move
  away from a core something else is running on, and each op waits for its slowest thread.

With the bounded spin (``SPIN_US``, the default since), the same two sides: three nodes against
one 0.90x pinned against 0.82x not, and pinned every cluster the fastest (``pipeline.py
--variants default,nospin,pin``); ``api.py`` pinned against not in ABAB order, one pair even or
in favour of pinning, the next against it (three nodes, 4 and 8 streams: 78-127 tok/s pinned
against 101-142 not); one step beside one busy process 14.9 ms pinned against 16.2 ms, beside
two 26.3 against 25.7 (``onnx_spin.py --spin 15 --pin off,on``). Still a trade.

Only the calling thread is pinned, and only for the length of a run: other threads of the
process (and threads it starts later) keep every core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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


SYSFS_CPU = Path("/sys/devices/system/cpu")


def core_plan(threads: int, allowed: set[int] | None = None, sysfs: Path = SYSFS_CPU) -> CorePlan | None:
    """Cores for a step of ``threads`` threads within ``allowed`` (default: this process's
    cores), or None where pinning does not apply: one thread (nothing to keep apart), more threads
    than physical cores, or a platform without thread affinity (macOS).

    One logical CPU per physical core (two threads on the two hyperthreads of one core would
    share its execution units), and the fastest cores first where they differ (big.LITTLE: the
    big ones), read from ``sysfs``; without that information every CPU counts as a core of its own.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads < 2:
        return None
    cores: dict[str, int] = {}  # physical core -> its first allowed logical CPU
    capacity: dict[int, int] = {}
    for cpu in cpus:
        core = _read(sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list") or f"cpu{cpu}"
        if core not in cores:
            cores[core] = cpu
            capacity[cpu] = _capacity(sysfs / f"cpu{cpu}")
    if threads > len(cores):
        return None
    fastest = sorted(cores.values(), key=lambda cpu: (-capacity[cpu], cpu))[:threads]
    chosen = sorted(fastest)
    return CorePlan(chosen[0], tuple(chosen[1:]))


def _capacity(cpu_dir: Path) -> int:
    """A CPU's relative speed: the kernel's ``cpu_capacity`` (big.LITTLE), else its top clock,
    else 0 (unknown: all equal)."""
    for name in ("cpu_capacity", "cpufreq/cpuinfo_max_freq"):
        value = _read(cpu_dir / name)
        if value.isdigit():
            return int(value)
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
