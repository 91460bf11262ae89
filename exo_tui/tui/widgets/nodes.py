"""The nodes table: one row per node, keyed by node id, updated cell by cell.

Rows keep their keys across refreshes so the cursor stays on the same node; cells whose value
changed are shown highlighted for two refreshes (k9s "deltas"). ``space`` marks nodes; drain and
undrain act on the marked set, or on the selected node when nothing is marked.
"""

from __future__ import annotations

from rich.console import JustifyMethod
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from exo_tui.cluster.view import ClusterSnapshot, NodeView
from exo_tui.tui import keymap
from exo_tui.tui.format import (
    STATE_COLOR_VAR,
    STATE_GLYPH,
    fmt_age,
    fmt_layers,
    fmt_mem,
    fmt_rate,
    short,
)
from exo_tui.tui.owner import exo_app
from exo_tui.tui.widgets.style import theme_style
from exo_tui.tui.widgets.tables import selected_row_key

COLUMNS: tuple[tuple[str, str], ...] = (
    ("mark", " "),
    ("state", "state"),
    ("name", "name"),
    ("address", "address"),
    ("backend", "backend"),
    ("memory", "memory"),
    ("cpu", "cpu%"),
    ("score", "score"),
    ("layers", "layers"),
    ("tok_s", "tok/s"),
    ("hb", "hb age"),
)
# Columns whose changes are marked; live gauges (cpu, memory, rates, ages) change every second.
DELTA_COLUMNS = frozenset({"state", "address", "backend", "score", "layers"})
DELTA_REFRESHES = 2


def node_cells(node: NodeView, marked: bool) -> dict[str, str]:
    if node.score is None:
        score = "—"
    elif node.eligible:
        score = f"{node.score:.0f}"
    else:
        score = f"{node.score:.0f} ✗ {short(node.ineligible_reason, 28)}" if node.ineligible_reason else f"{node.score:.0f} ✗"
    layers = fmt_layers(node.layers)
    if node.pinned:
        layers += " ⚑"
    return {
        "mark": "✓" if marked else " ",
        "state": f"{STATE_GLYPH.get(node.state, '?')} {node.state}",
        "name": node.name,
        "address": f"{node.address}:{node.port}",
        "backend": node.backend or ("/".join(node.backends) if node.backends else "—"),
        "memory": fmt_mem(node.memory_used_bytes, node.memory_total_bytes),
        "cpu": f"{node.cpu_percent:.0f}",
        "score": score,
        "layers": layers,
        "tok_s": fmt_rate(node.tok_per_s),
        "hb": fmt_age(node.heartbeat_age_s),
    }


class NodesTable(DataTable):
    """Nodes of the cluster (scope ``nodes`` of the keymap)."""
    ALLOW_MAXIMIZE = True

    HELP_SCOPE = "nodes"
    BINDINGS = keymap.bindings("nodes")
    DANGEROUS = keymap.dangerous_actions("nodes")

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.marked: set[str] = set()
        self.filter_text = ""
        self._snapshot: ClusterSnapshot | None = None
        self._order: list[str] = []
        self._values: dict[str, dict[str, str]] = {}
        self._changed: dict[tuple[str, str], int] = {}
        self._shown_hot: set[tuple[str, str]] = set()
        self._generation = 0

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self.border_title = "Nodes"

    # ------------------------------------------------------------------ data

    @property
    def selected_node_id(self) -> str | None:
        return selected_row_key(self)

    def targets(self) -> tuple[str, ...]:
        """The marked nodes, or the selected one."""
        if self.marked:
            return tuple(n for n in self._order if n in self.marked) + tuple(
                sorted(self.marked - set(self._order))
            )
        node = self.selected_node_id
        return (node,) if node else ()

    def _visible(self, snapshot: ClusterSnapshot) -> list[NodeView]:
        nodes = sorted(snapshot.nodes, key=lambda n: (n.name, n.node_id))
        text = self.filter_text.lower()
        if text:
            nodes = [n for n in nodes if text in f"{n.name} {n.address} {n.state} {n.backend} {n.node_id}".lower()]
        return nodes

    def show(self, snapshot: ClusterSnapshot) -> None:
        self._snapshot = snapshot
        self._generation += 1
        gen = self._generation
        nodes = self._visible(snapshot)
        ids = [n.node_id for n in nodes]
        self.marked &= {n.node_id for n in snapshot.nodes}
        new_values = {n.node_id: node_cells(n, n.node_id in self.marked) for n in nodes}
        for node_id, cells in new_values.items():
            old = self._values.get(node_id)
            if old is None:
                continue
            for col in DELTA_COLUMNS:
                if old.get(col) != cells[col]:
                    self._changed[(node_id, col)] = gen
        self._changed = {k: g for k, g in self._changed.items() if gen - g < DELTA_REFRESHES}
        by_id = {n.node_id: n for n in nodes}
        if ids != self._order:
            selected = self.selected_node_id
            self.clear(columns=False)
            for node_id in ids:
                self.add_row(*self._row_texts(by_id[node_id], new_values[node_id]), key=node_id)
            self._order = ids
            if selected in ids:
                self.move_cursor(row=ids.index(selected), animate=False)
        else:
            for node_id in ids:
                old = self._values.get(node_id, {})
                for col, _ in COLUMNS:
                    hot = (node_id, col) in self._changed
                    was_hot = (node_id, col) in self._shown_hot
                    if old.get(col) != new_values[node_id][col] or hot != was_hot:
                        text = self._cell_text(by_id[node_id], col, new_values[node_id][col])
                        # Measuring every column again lays out the whole screen: only when a
                        # value is wider than its column so far (metrics change every second).
                        wider = text.cell_len > self.columns[ColumnKey(col)].content_width
                        self.update_cell(node_id, col, text, update_width=wider)
        self._shown_hot = set(self._changed)
        self._values = new_values
        total = len(snapshot.nodes)
        shown = f"{len(ids)}/{total}" if self.filter_text else f"{total}"
        marks = f" · {len(self.marked)} marked" if self.marked else ""
        filt = f" · /{self.filter_text}" if self.filter_text else ""
        self.border_title = f"Nodes [{shown}]{marks}{filt}"

    def restyle(self) -> None:
        """Re-render every cell (after a theme change)."""
        if self._snapshot is not None:
            self._order = []
            self.show(self._snapshot)

    def _row_texts(self, node: NodeView, values: dict[str, str]) -> list[Text]:
        return [self._cell_text(node, col, values[col]) for col, _ in COLUMNS]

    def _cell_text(self, node: NodeView, col: str, value: str) -> Text:
        app = self.app
        if col == "state":
            style = theme_style(app, STATE_COLOR_VAR.get(node.state, "foreground"), bold=True)
        elif col == "score" and not node.eligible:
            style = theme_style(app, "error")
        elif col == "mark":
            style = theme_style(app, "accent", bold=True)
        elif col == "memory" and node.memory_total_bytes and node.memory_used_bytes / node.memory_total_bytes >= 0.8:
            style = theme_style(app, "warning")
        elif col == "cpu" and node.cpu_percent >= 90:
            style = theme_style(app, "warning")
        elif col == "hb" and node.heartbeat_age_s is not None and node.heartbeat_age_s > 3:
            style = theme_style(app, "error")
        else:
            style = theme_style(app, "foreground")
        if (node.node_id, col) in self._changed:
            style = style + theme_style(app, "accent", bold=True, reverse=True)
        justify: JustifyMethod = "right" if col in {"cpu", "tok_s", "hb", "memory"} else "left"
        return Text(value, style=style, justify=justify)

    # ------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.DANGEROUS and getattr(self.app, "readonly", False):
            return False
        return True

    def action_details(self) -> None:
        node = self.selected_node_id
        if node:
            exo_app(self).open_node_detail(node)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_details()

    def action_mark(self) -> None:
        node = self.selected_node_id
        if not node:
            return
        self.marked ^= {node}
        if self._snapshot is not None:
            self.show(self._snapshot)
        if self.cursor_row < self.row_count - 1:
            self.move_cursor(row=self.cursor_row + 1, animate=False)

    def action_filter(self) -> None:
        screen = self.screen
        if hasattr(screen, "open_filter"):  # the main screen's filter box
            screen.open_filter()

    def action_drain(self) -> None:
        exo_app(self).request_change("drain", self.targets())

    def action_undrain(self) -> None:
        exo_app(self).request_change("undrain", self.targets())

    def action_remove(self) -> None:
        exo_app(self).request_change("remove", self.targets())

    def action_pin(self) -> None:
        node_id = self.selected_node_id
        if not node_id or self._snapshot is None:
            return
        node = next((n for n in self._snapshot.nodes if n.node_id == node_id), None)
        if node is None:
            return
        exo_app(self).request_change("unpin" if node.pinned else "pin", (node_id,))

    def action_pin_layers(self) -> None:
        node_id = self.selected_node_id
        node = next((n for n in self._snapshot.nodes if n.node_id == node_id), None) if self._snapshot else None
        if node is not None:
            exo_app(self).request_pin_layers(node)
