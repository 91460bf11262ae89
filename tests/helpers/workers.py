"""This process's share of what the suite's workers (pytest-xdist, ``make test``) would otherwise
all pick from: loopback ports (:func:`tests.helpers.sshd.free_port`), network namespaces' subnets
(:class:`tests.helpers.netns.NetnsLab`). Worker ``gwN`` of M takes the N-th of M equal parts; a
serial run takes the whole. Each part is still checked free when taken (other test runs, other
programs), but two workers of one run never race for the same one."""

from __future__ import annotations

import os


def slot() -> tuple[int, int]:
    """(this worker's index, the number of workers) under pytest-xdist; (0, 1) in a serial run."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (name.startswith("gw") and name[2:].isdigit()):
        return 0, 1
    index = int(name[2:])
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    return index, max(count, index + 1)


def share(lo: int, hi: int) -> range:
    """This worker's part of ``range(lo, hi)`` (all of it in a serial run)."""
    index, count = slot()
    width = (hi - lo) // count
    return range(lo + index * width, lo + (index + 1) * width)
