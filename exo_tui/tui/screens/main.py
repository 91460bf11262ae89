"""The dashboard: header, nodes, partition bar and ring, chat, events; `:` command line and `/` filter."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.suggester import SuggestFromList
from textual.widgets import Footer, Input

from exo_tui.cluster.view import ClusterSnapshot
from exo_tui.tui import keymap
from exo_tui.tui.owner import exo_app
from exo_tui.tui.widgets.chat import ChatPane
from exo_tui.tui.widgets.cluster import ClusterHeader, PartitionBar, Topology
from exo_tui.tui.widgets.cluster_strip import ClusterStrip
from exo_tui.tui.widgets.coordinators import CoordinatorsPane
from exo_tui.tui.widgets.events import EventsLog
from exo_tui.tui.widgets.nodes import NodesTable


class MainScreen(Screen):
    HELP_SCOPE = "global"

    def compose(self) -> ComposeResult:
        yield ClusterHeader(id="header")
        yield CoordinatorsPane(id="coordinators")
        yield ClusterStrip(id="strip")
        with Vertical(id="top"):
            yield Input(placeholder="filter nodes (esc clears)", id="filter")
            yield NodesTable(id="nodes")
            with Vertical(id="plan"):
                yield PartitionBar(id="partition")
                yield Topology(id="topology")
        with Horizontal(id="bottom"):
            yield ChatPane(id="chat")
            yield EventsLog(id="events")
        yield Input(
            placeholder=":nodes :hosts :chat :events :model NAME :theme NAME",
            id="command",
            select_on_focus=False,
            suggester=SuggestFromList([f":{c}" for c in keymap.COMMANDS], case_sensitive=False),
        )
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#plan").border_title = "Partition · ring"
        self.query_one(NodesTable).focus()

    def on_resize(self) -> None:
        self.set_class(self.size.width < 100, "-narrow")
        self.set_class(self.size.height < 32, "-short")
        self.query_one(PartitionBar).compact = self.size.height < 32
        self.query_one(PartitionBar).refresh(layout=True)
        self.query_one(ClusterHeader).compact = self.size.width < 100

    @property
    def small(self) -> bool:
        return self.size.height < 32

    # ------------------------------------------------------------------ rendering

    def render_snapshot(self, snapshot: ClusterSnapshot, *, now: float, paused: bool, readonly: bool) -> None:
        self.query_one(ClusterHeader).show(snapshot, now=now, paused=paused, readonly=readonly)
        self.query_one(CoordinatorsPane).show(snapshot)
        self.query_one(NodesTable).show(snapshot)
        self.query_one(PartitionBar).show(snapshot)
        self.query_one(Topology).show(snapshot)
        self.query_one(ClusterStrip).show(snapshot.metrics, {n.node_id: n.name for n in snapshot.nodes})

    def toggle_strip(self, snapshot: ClusterSnapshot | None, names: dict[str, str]) -> None:
        strip = self.query_one(ClusterStrip)
        strip.toggle()
        strip.show(snapshot.metrics if snapshot else None, names)

    def render_header(self, snapshot: ClusterSnapshot | None, *, now: float, paused: bool, readonly: bool) -> None:
        self.query_one(ClusterHeader).show(snapshot, now=now, paused=paused, readonly=readonly)

    # ------------------------------------------------------------------ filter and command line

    def open_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        self.set_focus(box)  # at once: keys already queued (a fast typist, a paste) go to the box

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        table = self.query_one(NodesTable)
        table.filter_text = event.value.strip()
        if table._snapshot is not None:
            table.show(table._snapshot)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(NodesTable).focus()
        if not event.value.strip():
            event.input.display = False

    def open_command_line(self) -> None:
        box = self.query_one("#command", Input)
        box.value = ":"
        box.display = True
        self.set_focus(box)  # at once: keys already queued (a fast typist, a paste) go to the box
        box.cursor_position = 1

    @on(Input.Submitted, "#command")
    def _command_done(self, event: Input.Submitted) -> None:
        event.stop()
        event.input.display = False
        self.set_focus(self.query_one(NodesTable))  # now, so a pane the command focuses stays focused
        exo_app(self).run_command(event.value)

    def on_key(self, event) -> None:  # noqa: ANN001
        if event.key != "escape":
            return
        focused = self.focused
        if isinstance(focused, Input) and focused.id == "command":
            event.stop()
            focused.display = False
            self.query_one(NodesTable).focus()
        elif isinstance(focused, Input) and focused.id == "filter":
            event.stop()
            focused.value = ""
            focused.display = False
            self.query_one(NodesTable).focus()
        elif self.maximized is not None and not (isinstance(focused, Input) and focused.id == "chat-input"):
            event.stop()
            self.minimize()

    def focus_pane(self, name: str) -> None:
        """Focus a pane; on a short terminal, chat and events are shown alone (esc restores)."""
        target = {"nodes": "#nodes", "chat": "#chat-input", "events": "#events"}[name]
        if self.maximized is not None:
            self.minimize()
        if self.small and name in ("chat", "events"):
            self.maximize(self.query_one("#chat" if name == "chat" else "#events"), container=False)
        self.set_focus(self.query_one(target))  # at once: keys typed right after (``c`` then a question) go there
