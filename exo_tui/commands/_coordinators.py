"""The coordinators of a set, as ``exo-tui status`` shows them (from ``GET /health``)."""

from __future__ import annotations

from typing import Any


def coordinators_of(health: dict[str, Any]) -> list[dict[str, Any]]:
    """The set's coordinators ``/health`` lists; empty for a coordinator not of a set."""
    return list(health.get("coordinators") or [])


def print_coordinators(console: Any, health: dict[str, Any]) -> None:
    from rich.table import Table

    rows = coordinators_of(health)
    if not rows:
        return
    leader = health.get("leader_api") or "none (an election is under way, or no majority)"
    console.print(f"coordinators · term {health.get('term')} · leader {leader}", highlight=False, markup=False)
    t = Table()
    for col in ("coordinator", "raft", "API", "role", "term", "lag"):
        t.add_column(col, justify="right" if col in ("term", "lag") else "left")
    glyph = {"leader": "★", "standby": "●", "unreachable": "✖"}
    for c in rows:
        lag = "—" if c.get("lag", -1) < 0 else f"{c['lag']} entries"
        here = " (this one)" if c.get("address") == health.get("coordinator") else ""
        t.add_row(f"{c.get('name') or '?'}{here}", c.get("address", ""), c.get("api", ""),
                  f"{glyph.get(c.get('role', ''), '·')} {c.get('role', '')}", str(c.get("term", "")), lag)
    console.print(t)
