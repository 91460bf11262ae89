"""Hosts view (`:hosts`): discovered and configured hosts that are not nodes yet, and bootstrap
progress step by step for the selected host."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Input, Static

from exo_tui.cluster.view import ClusterSnapshot, HostView
from exo_tui.tui import keymap
from exo_tui.tui.format import HOST_STATE_COLOR_VAR, HOST_STATE_GLYPH, STEP_COLOR_VAR, STEP_GLYPH, fmt_clock
from exo_tui.tui.owner import exo_app
from exo_tui.tui.screens.filtered import FilteredScreen, KeyedTable
from exo_tui.tui.widgets.style import theme_style

BOOTSTRAP_STEPS = ("connect", "detect", "venv", "upload", "install", "key", "start", "handshake", "done")
HOST_COLUMNS = (("state", "state"), ("host", "host"), ("port", "port"), ("user", "user"), ("source", "source"), ("detail", "detail"))


class HostsTable(KeyedTable):
    HELP_SCOPE = "hosts"
    COLUMNS = HOST_COLUMNS

    @property
    def selected_host(self) -> str | None:
        return self.selected_key


class HostsScreen(FilteredScreen):
    HELP_SCOPE = "hosts"
    BINDINGS = keymap.bindings("hosts")
    DANGEROUS = keymap.dangerous_actions("hosts")
    TABLE = HostsTable

    def __init__(self) -> None:
        super().__init__()
        self._hosts: list[HostView] = []
        self._order: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static(id="hosts-title")
        with Vertical(id="hosts-body"):
            yield Input(placeholder="filter hosts (esc clears)", id="filter")
            yield HostsTable(id="hosts")
            yield Static(id="bootstrap-progress")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(HostsTable).border_title = "Hosts"
        self.query_one("#bootstrap-progress").border_title = "Bootstrap"
        self.query_one(HostsTable).focus()
        snapshot = getattr(self.app, "snapshot", None)
        if snapshot is not None:
            self.render_snapshot(snapshot)

    # ------------------------------------------------------------------ rendering

    def render_snapshot(self, snapshot: ClusterSnapshot, **_: object) -> None:
        app = self.app
        self._hosts = [h for h in snapshot.hosts if h.state != "node"] + [h for h in snapshot.hosts if h.state == "node"]
        title = Text(" Hosts ", style=theme_style(app, "primary", bold=True, reverse=True))
        title.append(
            "  discovered and configured hosts · b bootstraps the selected one · a adds one",
            style=theme_style(app, "foreground-muted"),
        )
        self.query_one("#hosts-title", Static).update(title)
        table = self.query_one(HostsTable)
        text = self.filter_text.lower()
        hosts = [h for h in self._hosts if not text or text in f"{h.host} {h.source} {h.state} {h.user}".lower()]
        keys = [h.host for h in hosts]
        selected = table.selected_host
        if keys != self._order:
            table.clear(columns=False)
            for h in hosts:
                table.add_row(*self._cells(h), key=h.host)
            self._order = keys
            if selected in keys:
                table.move_cursor(row=keys.index(selected), animate=False)
        else:
            for h in hosts:
                for (col, _label), shown in zip(HOST_COLUMNS, self._cells(h), strict=True):
                    table.update_cell(h.host, col, shown, update_width=True)
        table.border_title = f"Hosts [{len(hosts)}]" + (f" · /{self.filter_text}" if self.filter_text else "")
        self.render_progress()

    def _cells(self, h: HostView) -> list[Text]:
        app = self.app
        var = HOST_STATE_COLOR_VAR.get(h.state, "foreground")
        plain = theme_style(app, "foreground")
        return [
            Text(f"{HOST_STATE_GLYPH.get(h.state, '?')} {h.state}", style=theme_style(app, var, bold=True)),
            Text(h.host, style=plain),
            Text(str(h.port), style=plain),
            Text(h.user or "—", style=plain),
            Text(h.source or "—", style=theme_style(app, "foreground-muted")),
            Text(h.detail, style=theme_style(app, "error" if h.state == "failed" else "foreground-muted")),
        ]

    def render_progress(self) -> None:
        app = self.app
        host = self.query_one(HostsTable).selected_host
        box = self.query_one("#bootstrap-progress", Static)
        muted = theme_style(app, "foreground-muted")
        if host is None:
            box.update(Text("no hosts known yet: a adds one by name or address", style=muted))
            return
        steps = getattr(app, "bootstrap_steps", {}).get(host, {})
        box.border_title = f"Bootstrap · {host}"
        t = Text()
        if not steps:
            t.append(f"not bootstrapped from this console yet: b installs and starts a node agent on {host}", muted)
            box.update(t)
            return
        names = list(BOOTSTRAP_STEPS) + [s for s in steps if s not in BOOTSTRAP_STEPS]
        for i, step in enumerate(names):
            if i:
                t.append("\n")
            if step in steps:
                status, message, ts = steps[step]
                t.append(f" {STEP_GLYPH.get(status, '•')} ", theme_style(app, STEP_COLOR_VAR.get(status, "foreground"), bold=True))
                t.append(f"{step:<10}", theme_style(app, "foreground", bold=status == "running"))
                t.append(f" {status:<8}", theme_style(app, STEP_COLOR_VAR.get(status, "foreground")))
                t.append(f" {fmt_clock(ts)}", muted)
                if message:
                    t.append(f"  {message}", theme_style(app, "error" if status == "failed" else "foreground"))
            else:
                t.append(" · ", muted)
                t.append(f"{step:<10}", muted)
                t.append(" pending", muted)
        box.update(t)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.render_progress()

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.render_progress()

    # ------------------------------------------------------------------ actions

    def action_bootstrap(self) -> None:
        host = self.query_one(HostsTable).selected_host
        if host is None:
            self.notify("No host selected: a adds one.", severity="warning")
            return
        exo_app(self).start_bootstrap(host)

    def action_add_host(self) -> None:
        exo_app(self).action_add_host()

    def refilter(self) -> None:
        snapshot = getattr(self.app, "snapshot", None)
        if snapshot is not None:
            self.render_snapshot(snapshot)
