"""Which worker runs what when ``make test`` runs the suite on several processes (pytest-xdist
``-n auto --dist loadfile``; hooked in by tests/conftest.py).

* Whole test files go to a worker, so a module-scoped cluster starts once; the files of a
  :data:`SHARED` group go to one worker together, so their session fixture is set up once.
* The heaviest files start first (:data:`HEAVY_FIRST`), then the rest in collection order
  (integration, console, unit tests): the last pieces of work are short ones, so neither worker
  idles long at the end while the other finishes a long file.
* At most :data:`MAX_WORKERS` workers, one per CPU the process may run on.

xdist calls its schedulers through internal methods; this one overrides ``_split_scope`` (as
xdist's own loadgroup does) and reorders the queue before ``_assign_work_unit`` takes from it.
"""

from __future__ import annotations

import os
from typing import Any

from xdist.scheduler import LoadFileScheduling

MAX_WORKERS = 4
"""Enough for the suite's long files to overlap; more workers only wait on the same few long
files and multiply the node processes that compete for the cores."""

SHARED = {
    # netns_nodes (tests/integration/conftest.py): three namespaces, each bootstrapped over SSH
    "tests/integration/test_netns.py": "netns_nodes",
    "tests/integration/test_netns_pipeline.py": "netns_nodes",
}
"""Files that share an expensive session fixture: one unit of work per group."""

HEAVY_FIRST = (
    "tests/integration/test_live_ops.py",
    "tests/integration/test_pipeline.py",
    "tests/integration/test_big_model.py",
    "tests/integration/test_benchmarks.py",
    "tests/integration/test_bootstrap.py",
    "tests/tui/test_app_fake.py",
    "tests/tui/test_snapshots.py",
    "netns_nodes",
    "tests/integration/test_hostile.py",
    "tests/integration/test_speculative_ring.py",
    "tests/integration/test_node_rss.py",
)
"""The slowest files (or groups) of a serial ``make test`` (``--durations``), slowest first. Only
the order of the work comes from it: a file missing here starts in its turn."""


def auto_workers() -> int:
    """``-n auto``: one worker per CPU this process may run on, at most :data:`MAX_WORKERS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


class FileScheduling(LoadFileScheduling):
    """``--dist loadfile`` with :data:`SHARED` groups as one unit and :data:`HEAVY_FIRST` first."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return SHARED.get(path, path)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the queue is complete at the first assignment
            first: dict[str, int] = {}
            for i, nodeid in enumerate(self.collection or ()):
                first.setdefault(self._split_scope(nodeid), i)

            def rank(scope: str) -> tuple[int, int]:
                heavy = HEAVY_FIRST.index(scope) if scope in HEAVY_FIRST else len(HEAVY_FIRST)
                return heavy, first.get(scope, 0)

            for scope in sorted(self.workqueue, key=rank):
                self.workqueue.move_to_end(scope)
            self._ordered = True
        super()._assign_work_unit(node)
