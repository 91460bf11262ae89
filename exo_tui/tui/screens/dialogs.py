"""Modal screens: help, plan-change confirmation, yes/no questions and one-line prompts."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Button, Input, Static

from exo_tui.cluster.view import PlanPreview
from exo_tui.tui import keymap
from exo_tui.tui.format import fmt_bytes, fmt_layers
from exo_tui.tui.widgets.style import theme_style

ACTION_TITLES = {
    "drain": "Drain",
    "undrain": "Undrain",
    "rebalance": "Rebalance",
    "remove": "Remove",
    "pin": "Pin",
    "unpin": "Unpin",
    "model": "Load model",
}


class HelpScreen(ModalScreen[None]):
    """Keys of the pane that had focus, then the global ones (all from the keymap)."""

    BINDINGS = [("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, scope: str, *, readonly: bool = False) -> None:
        super().__init__()
        self.scope = scope
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="help"):
            yield Static(self._table(), id="help-body")
            yield Static(Text("esc closes · ctrl+p searches every action", justify="center"), classes="hint")

    def on_mount(self) -> None:
        dialog = self.query_one("#dialog")
        dialog.border_title = f"Help · {keymap.SCOPE_TITLES.get(self.scope, self.scope)}"

    def _table(self) -> Table:
        app = self.app
        table = Table(box=None, expand=True, show_header=False, padding=(0, 1))
        table.add_column("key", style=theme_style(app, "accent", bold=True), no_wrap=True)
        table.add_column("what", style=theme_style(app, "foreground", bold=True), no_wrap=True)
        table.add_column("help", style=theme_style(app, "foreground-muted"), ratio=1)
        scopes = [self.scope] if self.scope == "global" else [self.scope, "global"]
        for scope in scopes:
            table.add_row(Text(keymap.SCOPE_TITLES[scope], style=theme_style(app, "primary", bold=True)), "", "")
            for key, what, help_text in keymap.scope_rows(scope, readonly=self.readonly):
                table.add_row(key, what, help_text)
        table.add_row(Text("Commands (:)", style=theme_style(app, "primary", bold=True)), "", "")
        for name in keymap.command_names(readonly=self.readonly):
            table.add_row(f":{name}", "", keymap.COMMANDS[name][0])
        return table


class ConfirmChange(ModalScreen[bool]):
    """Shows what a plan change does (layers moving, bytes, predicted tok/s) and defaults to Cancel."""

    BINDINGS = keymap.bindings("confirm")

    def __init__(self, preview: PlanPreview, names: dict[str, str]) -> None:
        super().__init__()
        self.preview = preview
        self.names = names

    def compose(self) -> ComposeResult:
        p = self.preview
        with Vertical(id="dialog", classes="confirm"):
            with VerticalScroll(id="confirm-body"):
                yield Static(self._body(), id="diff")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel", variant="primary")
                if not p.error:
                    yield Button(f"{ACTION_TITLES.get(p.action, p.action.title())} (y)", id="apply", variant="error")

    def on_mount(self) -> None:
        p = self.preview
        targets = ", ".join(self.names.get(t, t) for t in p.targets)
        if p.layers is not None:
            targets = f"layers {p.layers[0]}–{p.layers[1] - 1} to {targets}"
        self.query_one("#dialog").border_title = f"{ACTION_TITLES.get(p.action, p.action.title())} {targets}".strip() + "?"
        self.query_one("#cancel", Button).focus()

    def _node_label(self, node_id: str | None) -> str:
        return "(fresh load)" if node_id is None else self.names.get(node_id, node_id)

    def _body(self) -> Table:
        app = self.app
        p = self.preview
        muted = theme_style(app, "foreground-muted")
        table = Table(box=None, expand=True, show_header=True, padding=(0, 1), header_style=muted)
        table.add_column("layers", no_wrap=True)
        table.add_column("from", no_wrap=True)
        table.add_column("", no_wrap=True)
        table.add_column("to", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        for move in p.moves:
            table.add_row(
                fmt_layers((move.start, move.end)),
                Text(self._node_label(move.src), style=theme_style(app, "warning")),
                "→",
                Text(self._node_label(move.dst), style=theme_style(app, "success")),
                fmt_bytes(move.nbytes),
            )
        outer = Table(box=None, expand=True, show_header=False, padding=(0, 0))
        outer.add_column()
        if p.error:
            outer.add_row(Text(f"✗ {p.error}", style=theme_style(app, "error", bold=True)))
            return outer
        if p.moves:
            outer.add_row(table)
        else:
            outer.add_row(Text("No layers move.", style=muted))
        layers = sum(m.end - m.start for m in p.moves)
        summary = Text()
        summary.append(f"{layers} layer(s) move, {fmt_bytes(p.bytes_moved or sum(m.nbytes for m in p.moves))}", theme_style(app, "foreground", bold=True))
        summary.append("\npredicted ", muted)
        summary.append(f"{p.tok_per_s_before:.1f}", theme_style(app, "foreground"))
        summary.append(" → ", muted)
        better = p.tok_per_s_after >= p.tok_per_s_before
        summary.append(f"{p.tok_per_s_after:.1f} tok/s", theme_style(app, "success" if better else "warning", bold=True))
        if p.new_plan is not None:
            summary.append(f"  (plan v{p.new_plan.version})", muted)
        outer.add_row(summary)
        if p.note:
            outer.add_row(Text(f"! {p.note}", style=theme_style(app, "warning")))
        return outer

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "apply")

    def action_cancel(self) -> None:
        self.dismiss(False)

    def action_apply(self) -> None:
        if not self.preview.error:
            self.dismiss(True)


class Question(ModalScreen[bool]):
    """A yes/no question that defaults to No (e.g. trusting a new host key)."""

    BINDINGS = [("escape,n", "answer(False)", "No"), ("y", "answer(True)", "Yes")]

    def __init__(self, title: str, body: str, yes: str = "Yes") -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="question"):
            yield Static(self.body, id="question-body")
            with Horizontal(classes="buttons"):
                yield Button("No", id="no", variant="primary")
                yield Button(f"{self.yes} (y)", id="yes", variant="warning")

    def on_mount(self) -> None:
        self.query_one("#dialog").border_title = self.title_text
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class Prompt(ModalScreen[str | None]):
    """One line of input (a host to add, a model to load); esc cancels."""

    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, title: str, placeholder: str = "", suggestions: list[str] | None = None, value: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.placeholder = placeholder
        self.suggestions = suggestions or []
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="prompt"):
            suggester = SuggestFromList(self.suggestions, case_sensitive=False) if self.suggestions else None
            yield Input(value=self.value, placeholder=self.placeholder, suggester=suggester, id="prompt-input")
            if self.suggestions:
                yield Static("known: " + ", ".join(self.suggestions), classes="hint")

    def on_mount(self) -> None:
        self.query_one("#dialog").border_title = self.title_text
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
