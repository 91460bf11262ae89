"""The coordinators pane: a set's coordinators (``exo-tui serve --coordinators``), their roles,
the term and each one's replication lag, one line under the header. Hidden for a single
coordinator (the snapshot lists none)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App
from textual.widgets import Static

from exo_tui.cluster.view import ClusterSnapshot
from exo_tui.tui.widgets.style import theme_style

GLYPHS = {"leader": "★", "standby": "●", "unreachable": "✖"}
ROLE_STYLES = {"leader": "success", "standby": "foreground", "unreachable": "error"}


def coordinators_line(app: App[Any], snapshot: ClusterSnapshot) -> Text:
    muted = theme_style(app, "foreground-muted")
    t = Text(no_wrap=False, overflow="fold")
    terms = {c.term for c in snapshot.coordinators}
    t.append(" coordinators ", muted)
    t.append(f"term {max(terms)}" if terms else "", theme_style(app, "foreground"))
    for c in snapshot.coordinators:
        t.append("  ·  ", muted)
        t.append(f"{GLYPHS.get(c.role, '·')} {c.name or c.address} {c.role}",
                 theme_style(app, ROLE_STYLES.get(c.role, "foreground"), bold=c.role == "leader"))
        if c.lag > 0:
            t.append(f" lag {c.lag}", theme_style(app, "warning"))
    return t


class CoordinatorsPane(Static):
    _last: Text | None = None

    def show(self, snapshot: ClusterSnapshot | None) -> None:
        self.display = bool(snapshot and snapshot.coordinators)
        if snapshot is None or not snapshot.coordinators:
            return
        line = coordinators_line(self.app, snapshot)
        if line != self._last:
            self._last = line
            self.update(line)
