"""The start-up benchmark of node agents, measured once a test session (see :func:`share_benchmarks`)."""

from __future__ import annotations

import json
from pathlib import Path

BENCHMARK_CACHE = "benchmark-cache.json"  # a node's measured layer timings, in its EXO_TUI_HOME
_measured: dict[str, object] = {}  # what the nodes of this test session measured (the cache's entries)


def share_benchmarks(home: Path) -> None:
    """Give ``home`` the layer timings nodes of earlier tests measured on this machine, and keep
    what its nodes measured: the start-up benchmark then runs once a backend per session, not
    once a home (seconds a node set on a busy machine), as on a machine whose home persists."""
    path = home / BENCHMARK_CACHE
    try:
        found = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        found = {}
    _measured.update({k: v for k, v in found.items() if k not in _measured})
    if _measured.keys() - found.keys():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**_measured, **found}, indent=1))
