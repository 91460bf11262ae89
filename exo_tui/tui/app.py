"""The exo-tui console: a Textual app over :class:`~exo_tui.cluster.view.ClusterControl`.

The app only ever talks to the cluster through that contract: it reads ``snapshot()`` once per
refresh (``Z`` pauses), follows the event bus in a worker, and runs every slow call (previews,
plan changes, bootstrap, model loads, chat) in a worker that reports back by message, so keys keep
working while an answer streams.

One concern at ~600 lines: the app's wiring (panes, keys, workers and their messages); the panes,
screens and their help live in widgets/ and screens/.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Protocol, runtime_checkable

from textual import work
from textual.app import App, ScreenStackError, SystemCommand
from textual.css.query import NoMatches
from textual.dom import DOMNode
from textual.screen import ModalScreen, Screen
from textual.widgets import Input

import themes
from exo_tui import events as ev
from exo_tui.cluster.view import (
    PLAN_ACTIONS,
    Action,
    ClusterControl,
    ClusterSnapshot,
    Command,
    HostKeyUnknown,
    PlanPreview,
    parse_layers,
)
from exo_tui.tui import keymap
from exo_tui.tui.messages import ActionDone, ClusterEventReceived, HostKeyQuestion, PreviewReady
from exo_tui.tui.screens.detail import NodeDetailScreen
from exo_tui.tui.screens.dialogs import ConfirmChange, HelpScreen, Prompt, Question
from exo_tui.tui.screens.hosts import HostsScreen
from exo_tui.tui.screens.main import MainScreen
from exo_tui.tui.screens.models import ModelsScreen
from exo_tui.tui.widgets.chat import ChatPane
from exo_tui.tui.widgets.events import EventsLog
from exo_tui.tui.widgets.nodes import NodesTable

# Plan changes that open a confirmation (the others apply straight after their preview).
CONFIRM_ACTIONS = frozenset({Action.DRAIN, Action.REBALANCE, Action.REMOVE, Action.MODEL})
# Events after which the tables should refresh at once rather than at the next tick.
STRUCTURAL = (
    ev.NodeJoined,
    ev.NodeFailed,
    ev.NodeGone,
    ev.NodeStateChanged,
    ev.NodeDiscovered,
    ev.PlanChanged,
    ev.HostDiscovered,
    ev.HostGone,
    ev.BootstrapProgress,
)
GLOBAL_ACTIONS = frozenset(k.action for k in keymap.specs("global"))

log = logging.getLogger("exo_tui.tui")



@runtime_checkable
class Restyles(Protocol):
    """A widget that redraws itself in the theme's colours."""

    def restyle(self) -> None: ...

class ExoApp(App):
    """``control`` is the cluster; ``on_start``/``on_stop`` (optional) start and stop it on this
    app's event loop (the embedded coordinator); ``on_theme_change`` saves the chosen theme."""

    CSS_PATH = "app.tcss"
    TITLE = "exo-tui"
    BINDINGS = keymap.bindings("global")
    DANGEROUS = keymap.dangerous_actions("global")

    def __init__(
        self,
        control: ClusterControl,
        *,
        readonly: bool = False,
        theme: str | None = None,
        on_theme_change: Callable[[str], Any] | None = None,
        on_start: Callable[[], Awaitable[Any]] | None = None,
        on_stop: Callable[[], Awaitable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
        refresh_s: float = 1.0,
        follow_events: bool = True,
    ) -> None:
        super().__init__()
        self.control = control
        self._readonly_flag = readonly
        self.readonly = readonly
        self._initial_theme = theme or themes.DEFAULT_THEME
        self._on_theme_change = on_theme_change
        self._on_start = on_start
        self._on_stop = on_stop
        self._stopped = False
        self.clock = clock
        self.refresh_s = refresh_s
        self.follow_events = follow_events
        self.snapshot: ClusterSnapshot | None = None
        self.paused = False
        self._paused_events: list[ev.Event] = []
        self._refresh_pending = False
        self.bootstrap_steps: dict[str, dict[str, tuple[str, str, float]]] = {}
        self._joined_names: dict[str, str] = {}  # node id -> name, from node_joined events
        self.main_screen: MainScreen | None = None

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        for theme in themes.THEMES:
            self.register_theme(theme)
        if self._initial_theme not in self.available_themes:
            self.notify(
                f"theme {self._initial_theme!r} is unknown: using {themes.DEFAULT_THEME} "
                f"(:theme lists the others)",
                severity="warning",
            )
            self._initial_theme = themes.DEFAULT_THEME
        self.theme = self._initial_theme
        self._saved_theme = self._initial_theme
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.main_screen = MainScreen()
        self.push_screen(self.main_screen)
        self.call_after_refresh(self.refresh_now)
        self.set_interval(self.refresh_s, self.refresh_now, name="refresh")
        if self._on_start is not None:
            self._start_cluster()
        if self.follow_events:
            self._follow_events()

    @work(group="lifecycle")
    async def _start_cluster(self) -> None:
        if self._on_start is None:
            return
        try:
            await self._on_start()
        except Exception as exc:
            self.notify(f"The cluster did not start: {exc}", title="exo-tui", severity="error", timeout=30)
        self.refresh_now()

    async def _stop_cluster(self) -> None:
        if self._on_stop is not None and not self._stopped:
            self._stopped = True
            try:
                await self._on_stop()
            except Exception:  # the console is quitting: node agents it started exit with it anyway
                log.warning("the cluster did not stop cleanly", exc_info=True)

    async def action_quit(self) -> None:
        await self._stop_cluster()
        self.exit()

    async def on_unmount(self) -> None:
        await self._stop_cluster()

    # ------------------------------------------------------------------ refresh and events

    def refresh_now(self) -> None:
        """Read a snapshot and render it (unless paused)."""
        self._refresh_pending = False
        if self.main_screen is None or not self.main_screen.is_mounted:
            return
        if self.paused:
            self.main_screen.render_header(self.snapshot, now=self.clock(), paused=True, readonly=self.readonly)
            return
        try:
            snapshot = self.control.snapshot()
        except Exception as exc:  # the coordinator is still starting, or it broke
            self.main_screen.render_header(self.snapshot, now=self.clock(), paused=False, readonly=self.readonly)
            self.log.warning(f"snapshot failed: {exc}")
            return
        self.snapshot = snapshot
        readonly = self._readonly_flag or snapshot.readonly
        if readonly != self.readonly:
            self.readonly = readonly
            self.refresh_bindings()
        self._render_screens(snapshot)

    def _render_screens(self, snapshot: ClusterSnapshot) -> None:
        now = self.clock()
        seen: set[int] = set()
        try:
            top: Screen[object] | None = self.screen
        except ScreenStackError:  # the app is exiting: a refresh timer fired after its screens went
            top = None
        for screen in (self.main_screen, top):
            if screen is None or id(screen) in seen or not hasattr(screen, "render_snapshot"):
                continue
            seen.add(id(screen))
            try:
                screen.render_snapshot(snapshot, now=now, paused=self.paused, readonly=self.readonly)
            except NoMatches:  # the screen is being torn down (app exit)
                pass

    def _refresh_soon(self) -> None:
        if not self._refresh_pending and not self.paused:
            self._refresh_pending = True
            self.set_timer(0.05, self.refresh_now)

    @work(group="events")
    async def _follow_events(self) -> None:
        sub = self.control.events.subscribe(replay=True)
        try:
            while True:
                event = await sub.get()
                if isinstance(event, ev.TokenStreamed):
                    continue  # the chat has its tokens from its own stream: a message each cost ~3 % of a core
                self.post_message(ClusterEventReceived(event))
        finally:
            sub.close()

    def on_cluster_event_received(self, message: ClusterEventReceived) -> None:
        if self.paused:
            self._paused_events.append(message.event)
            return
        self._take_event(message.event)

    def _take_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.NodeJoined):  # its next events come before a snapshot names it
            self._joined_names[event.node_id] = event.name
        if isinstance(event, ev.BootstrapProgress):
            self.bootstrap_steps.setdefault(event.host, {})[event.step] = (event.status, event.message, event.ts)
            if isinstance(self.screen, HostsScreen):
                self.screen.render_progress()
        if isinstance(event, ev.ShardProgress | ev.NodeStateChanged) and (picker := self._picker()) is not None:
            picker.on_load_event(event)
        if self.main_screen is not None and self.main_screen.is_mounted:
            for log_view in self.main_screen.query(EventsLog):  # none while the app shuts down
                log_view.add_event(event, self.node_names())
        if isinstance(event, STRUCTURAL):
            self._refresh_soon()

    def log_local(self, event: ev.Event) -> None:
        """An event only this console knows of (e.g. a cancelled confirmation)."""
        self._take_event(event)

    # ------------------------------------------------------------------ names

    def node_names(self) -> dict[str, str]:
        names = dict(self._joined_names)
        if self.snapshot:
            names.update((n.node_id, n.name) for n in self.snapshot.nodes)
        return names

    def node_name(self, node_id: str) -> str:
        return self.node_names().get(node_id, node_id)

    # ------------------------------------------------------------------ keys

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.DANGEROUS and self.readonly:
            return False
        if action == "command_mode" and isinstance(self.focused, Input):
            return False  # a ':' typed into a text box is just a ':'

        if action in GLOBAL_ACTIONS and action not in {"command_palette", "quit"} and isinstance(self.screen, ModalScreen):
            return False
        return True

    def _focused_scope(self) -> str:
        node: DOMNode | None = self.screen.focused
        while node is not None:
            scope = getattr(node, "HELP_SCOPE", None)
            if scope:
                return scope
            node = node.parent
        return getattr(self.screen, "HELP_SCOPE", "global")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self._focused_scope(), readonly=self.readonly))

    def _to_main(self) -> MainScreen | None:
        while len(self.screen_stack) > 2 and self.screen is not self.main_screen:
            self.pop_screen()
        if self.screen is not self.main_screen and self.main_screen in self.screen_stack:
            self.pop_screen()
        return self.main_screen

    def _on_main(self, act: Callable[[MainScreen], object]) -> None:
        """``act(main screen)``: at once where it is showing (keys typed right after go where it
        puts the focus), else after closing the views above it."""
        if self.screen is self.main_screen:
            act(self.main_screen)
            return
        main = self._to_main()
        if main is not None:
            self.call_after_refresh(act, main)

    def action_command_mode(self) -> None:
        self._on_main(MainScreen.open_command_line)

    def action_focus_chat(self) -> None:
        self._focus_pane("chat")

    def _focus_pane(self, name: str) -> None:
        self._on_main(lambda main: main.focus_pane(name))

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            queued, self._paused_events = self._paused_events, []
            for event in queued:
                self._take_event(event)
        self.refresh_now()

    def action_toggle_strip(self) -> None:
        self._on_main(lambda main: main.toggle_strip(self.snapshot, self.node_names()))

    def action_toggle_theme(self) -> None:
        self.theme = "exo-light" if self.theme == "exo-dark" else "exo-dark"

    def _theme_changed(self, theme: Any) -> None:
        if self._on_theme_change is not None and theme.name != self._saved_theme:
            self._saved_theme = theme.name
            try:
                self._on_theme_change(theme.name)
            except Exception as exc:
                self.notify(f"Could not save the theme: {exc}", severity="warning")
        if self.main_screen is not None and self.main_screen.is_mounted:
            for widget in self.main_screen.query("NodesTable, EventsLog, PartitionBar, Topology, ClusterHeader, ClusterStrip"):
                if isinstance(widget, Restyles):
                    widget.restyle()
        if self.snapshot is not None:
            self._render_screens(self.snapshot)

    def action_maximize_pane(self) -> None:
        screen = self.screen
        if not isinstance(screen, MainScreen):
            return
        if screen.maximized is not None:
            screen.minimize()
            return
        node: DOMNode | None = screen.focused
        panes = (NodesTable, ChatPane, EventsLog)
        while node is not None and not isinstance(node, panes):
            node = node.parent
        if isinstance(node, panes):
            screen.maximize(node, container=False)

    async def action_back(self) -> None:
        if len(self.screen_stack) > 2 or (self.screen is not self.main_screen and len(self.screen_stack) > 1):
            self.pop_screen()
        elif self.main_screen is not None and self.main_screen.maximized is not None:
            self.main_screen.minimize()
        else:
            self.run_worker(self.action_quit(), group="lifecycle")

    def open_node_detail(self, node_id: str) -> None:
        self.push_screen(NodeDetailScreen(node_id))

    def open_hosts(self) -> None:
        if not isinstance(self.screen, HostsScreen):
            self._to_main()
            self.push_screen(HostsScreen())

    # ------------------------------------------------------------------ command mode

    def run_command(self, text: str) -> None:
        name, arg = keymap.parse_command(text)
        if not name:
            return
        if name not in keymap.COMMANDS:
            known = " ".join(f":{c}" for c in keymap.command_names(readonly=self.readonly))
            self.notify(f"Unknown command :{name}. Known: {known}", severity="error")
            return
        if self.readonly and name in keymap.DANGEROUS_COMMANDS:
            self.notify(f":{name} is not available in read-only mode.", severity="warning")
            return
        if name in ("nodes", "chat", "events"):
            self._focus_pane(name)
        elif name == "hosts":
            self.open_hosts()
        elif name == "model":
            if arg:
                self.request_change("model", (arg,))
            else:
                self.action_choose_model()
        elif name == "theme":
            if not arg:
                self.search_themes()
            elif arg in self.available_themes:
                self.theme = arg
            else:
                self.notify(
                    f"No theme {arg!r}. Try exo-dark, exo-light or one of: {', '.join(sorted(self.available_themes))}",
                    severity="error",
                )
        elif name == "set":
            self._set_chat_param(arg)
        elif name == "rebalance":
            self.action_rebalance()
        elif name == "unpin":
            if arg:
                self.request_change("unpin", (arg,))
            else:
                self.notify("Which node? :unpin NAME or :unpin ID (p on a selected node pins or unpins it)",
                            severity="warning")
        elif name == "metrics":
            self.action_toggle_strip()
        elif name == "pause":
            self.action_toggle_pause()
        elif name == "help":
            self.action_help()
        elif name == "quit":
            self.run_worker(self.action_quit(), group="lifecycle")

    def _set_chat_param(self, arg: str) -> None:
        """``:set NAME VALUE`` (or ``NAME=VALUE``) changes one sampling setting of the chat."""
        try:
            chat = self.main_screen.query_one(ChatPane) if self.main_screen is not None else None
        except NoMatches:
            chat = None
        if chat is None:
            self.notify("The chat is not open yet.", severity="warning")
            return
        key, _, value = arg.replace("=", " ", 1).strip().partition(" ")
        if key:
            try:
                chat.params = chat.params.with_setting(key, value)
            except ValueError as exc:
                self.notify(f"{exc}. Example: :set temperature 0", severity="error")
                return
        self.notify(chat.params.describe(self.control.snapshot().sampling), title="Chat settings")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for name in keymap.command_names(readonly=self.readonly):
            yield SystemCommand(f":{name}", keymap.COMMANDS[name][0], partial(self.run_command, name))
        for spec in keymap.specs("nodes"):
            if spec.dangerous and not self.readonly and spec.action in {"drain", "undrain", "pin", "remove"}:
                yield SystemCommand(
                    f"{spec.description} ({keymap.display_key(spec)})", spec.help, partial(self._node_action, spec.action)
                )
        yield from super().get_system_commands(screen)

    def _node_action(self, action: str) -> None:
        main = self._to_main()
        if main is not None:
            self.call_after_refresh(lambda: main.query_one(NodesTable).run_action(action))

    # ------------------------------------------------------------------ plan changes

    def action_rebalance(self) -> None:
        self.request_change("rebalance", ())

    def request_change(self, action: str, targets: tuple[str, ...], layers: tuple[int, int] | None = None) -> None:
        if self.readonly:
            self.notify("Read-only console: plan changes are off.", severity="warning")
            return
        if action != "rebalance" and not targets:
            self.notify(f"No node selected to {action}.", severity="warning")
            return
        if action == Action.MODEL:
            self._preview(Command(Action.MODEL, model=targets[0]))
        else:
            self._preview(Command(Action.of(action), targets, layers))

    def request_pin_layers(self, node: Any) -> None:
        """Ask for a range of layers (inclusive, as the table shows them) to pin to ``node``."""
        if self.readonly:
            self.notify("Read-only console: plan changes are off.", severity="warning")
            return
        current = f"{node.layers[0]}-{node.layers[1] - 1}" if node.layers else ""

        def entered(text: str | None) -> None:
            if not text:
                return
            try:
                layers = parse_layers(text)
            except ValueError as exc:
                self.notify(f"{exc}", title="Pin layers", severity="error")
                return
            self.request_change("pin", (node.node_id,), layers)

        self.push_screen(Prompt(f"Pin layers to {node.name} (START-END, inclusive)", "e.g. 0-9", value=current), entered)

    @work(group="plan")
    async def _preview(self, command: Command) -> None:
        try:
            preview = await self.control.preview(command)
        except Exception as exc:  # shown to the operator in the confirmation, which says it cannot be done
            log.warning("preview of %s failed", command.action, exc_info=True)
            preview = PlanPreview(action=command.action, targets=command.targets, error=str(exc) or type(exc).__name__,
                                  layers=command.layers)
        self.post_message(PreviewReady(preview))

    def on_preview_ready(self, message: PreviewReady) -> None:
        preview = message.preview
        if preview.action in CONFIRM_ACTIONS or preview.error or (preview.layers is not None and preview.moves):
            self.push_screen(ConfirmChange(preview, self.node_names()), partial(self._confirmed, preview))
        else:
            self._apply(preview)

    def _confirmed(self, preview: PlanPreview, ok: bool | None) -> None:
        if not ok:
            if not preview.error:
                self.log_local(ev.OperatorAction(action=preview.action, target=" ".join(preview.targets), result="cancelled",
                                                 detail="nothing changed", ts=self.clock()))
            return
        if preview.note:
            self.notify(preview.note, title=preview.action.title())
        if preview.action is Action.MODEL and (picker := self._picker()) is not None:
            picker.load_started(preview.targets[0])
        self._apply(preview)

    @work(group="plan")
    async def _apply(self, preview: PlanPreview) -> None:
        try:
            result = await self.control.apply(preview)
            error = result.error
        except Exception as exc:  # told to the operator in a notice
            error = str(exc) or type(exc).__name__
        self.post_message(ActionDone(preview.action, preview.targets, error=error))

    def on_action_done(self, message: ActionDone) -> None:
        names = ", ".join(self.node_name(t) for t in message.targets) if message.action in PLAN_ACTIONS else " ".join(message.targets)
        what = f"{message.action} {names}".strip()
        if message.error:
            self.notify(f"{what} failed: {message.error}", title="exo-tui", severity="error", timeout=10)
        else:
            self.notify(f"{what}: done" + (f" ({message.detail})" if message.detail else ""), title="exo-tui")
            if message.action in {Action.DRAIN, Action.UNDRAIN, Action.REMOVE} and self.main_screen is not None:
                self.main_screen.query_one(NodesTable).marked.clear()
        if message.action == Action.MODEL and (picker := self._picker()) is not None:
            if message.error:
                picker.load_finished(message.error)
            else:  # the new model serves: back to the chat
                self._to_main()
        self.refresh_now()

    # ------------------------------------------------------------------ hosts, bootstrap, model

    def action_bootstrap(self) -> None:
        self.open_hosts()

    def start_bootstrap(self, host: str, accept_new_host_key: bool = False) -> None:
        if self.readonly:
            self.notify("Read-only console: bootstrap is off.", severity="warning")
            return
        self.bootstrap_steps.pop(host, None) if not accept_new_host_key else None
        self._bootstrap(host, accept_new_host_key)

    @work(group="bootstrap")
    async def _bootstrap(self, host: str, accept_new_host_key: bool) -> None:
        try:
            await self.control.bootstrap(host, accept_new_host_key=accept_new_host_key)
        except HostKeyUnknown as exc:
            self.post_message(HostKeyQuestion(host, exc.fingerprint, exc.key_type, shown=exc.host))
            return
        except Exception as exc:  # told to the operator in a notice
            self.post_message(ActionDone("bootstrap", (host,), error=str(exc) or type(exc).__name__))
            return
        self.post_message(ActionDone("bootstrap", (host,)))

    def on_host_key_question(self, message: HostKeyQuestion) -> None:
        kind = f"{message.key_type} " if message.key_type else ""
        body = (
            f"{message.shown or message.host} presents a {kind}host key this machine has never seen:\n\n"
            f"    {message.fingerprint}\n\n"
            "Check it against the host (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) before trusting it."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self._bootstrap(message.host, True)
            else:
                self.log_local(ev.OperatorAction(action="bootstrap", target=message.host, result="cancelled", detail="host key not trusted", ts=self.clock()))

        self.push_screen(Question("Unknown host key", body, yes="Trust and continue"), answered)

    def action_add_host(self) -> None:
        def added(host: str | None) -> None:
            if host:
                self._add_host(host)

        self.push_screen(Prompt("Add host", "user@host[:port]"), added)

    @work(group="hosts")
    async def _add_host(self, host: str) -> None:
        try:
            await self.control.add_host(host)
        except Exception as exc:  # told to the operator in a notice
            self.post_message(ActionDone("add host", (host,), error=str(exc) or type(exc).__name__))
            return
        self.post_message(ActionDone("add host", (host,)))

    def action_choose_model(self) -> None:
        """The model picker (the machine's models, what the cluster can hold); enter previews a switch."""
        if self._picker() is None:
            self._to_main()
            self.push_screen(ModelsScreen())

    def _picker(self) -> ModelsScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, ModelsScreen)), None)
