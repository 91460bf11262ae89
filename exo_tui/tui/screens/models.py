"""Model picker (``m``, ``:model``): the models on the coordinator's machine, whether the cluster
can hold each now (the scheduler's plan for it and its predicted tok/s), filterable with ``/``.

Enter on one previews the switch (the plan diff and the bytes to load, in the usual confirmation);
once confirmed, the load's progress shows here node by node until the new model serves. Models the
runtime cannot run are listed greyed, with the reason.
"""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Input, Static

from exo_tui import events as ev
from exo_tui.cluster.view import ModelChoice
from exo_tui.tui import keymap
from exo_tui.tui.format import fmt_bytes
from exo_tui.tui.owner import exo_app
from exo_tui.tui.screens.filtered import FilteredScreen, KeyedTable
from exo_tui.tui.widgets.style import theme_style

MODEL_COLUMNS = (("mark", ""), ("name", "name"), ("family", "family"), ("params", "params"), ("quant", "quant"),
                 ("size", "size"), ("context", "context"), ("fits", "cluster"), ("where", "where"))


class ModelsTable(KeyedTable):
    HELP_SCOPE = "models"
    COLUMNS = MODEL_COLUMNS

    @property
    def selected_name(self) -> str | None:
        return self.selected_key


class ModelsScreen(FilteredScreen):
    HELP_SCOPE = "models"
    BINDINGS = keymap.bindings("models")
    DANGEROUS = keymap.dangerous_actions("models")
    TABLE = ModelsTable

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[ModelChoice] | None = None  # None: still looking
        self.error = ""
        self.loading_model: str | None = None  # the model being loaded from here
        self.progress: dict[str, tuple[str, int, int]] = {}  # node id -> (what, done bytes, total bytes)

    def compose(self) -> ComposeResult:
        yield Static(id="models-title")
        with Vertical(id="models-body"):
            yield Input(placeholder="filter models (esc clears)", id="filter")
            yield ModelsTable(id="models")
            yield Static(id="model-detail")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ModelsTable).border_title = "Models"
        self.query_one("#model-detail").border_title = "Model"
        self.query_one(ModelsTable).focus()
        self.render_all()
        self.reload()

    # ------------------------------------------------------------------ data

    @work(group="models", exclusive=True)
    async def reload(self) -> None:
        try:
            choices = await exo_app(self).control.models()
        except Exception as exc:
            self.error, choices = str(exc) or type(exc).__name__, []
        else:
            self.error = ""
        self.choices = list(choices)
        if self.is_mounted:
            self.render_all()

    def action_reload(self) -> None:
        self.choices = None
        self.render_all()
        self.reload()

    def shown(self) -> list[ModelChoice]:
        text = self.filter_text.lower()
        return [c for c in self.choices or () if not text or text in f"{c.name} {c.family} {c.quant} {c.where} {c.source}".lower()]

    # ------------------------------------------------------------------ rendering

    def render_snapshot(self, *_: object, **__: object) -> None:
        self.render_title()

    def render_all(self) -> None:
        self.render_title()
        table = self.query_one(ModelsTable)
        selected = table.selected_name
        rows = self.shown()
        table.clear(columns=False)
        for c in rows:
            table.add_row(*self._cells(c), key=c.name)
        names = [c.name for c in rows]
        if selected in names:
            table.move_cursor(row=names.index(selected), animate=False)
        else:
            current = next((i for i, c in enumerate(rows) if c.current), 0)
            table.move_cursor(row=current, animate=False)
        count = "…" if self.choices is None else str(len(rows))
        table.border_title = f"Models [{count}]" + (f" · /{self.filter_text}" if self.filter_text else "")
        self.render_detail()

    def render_title(self) -> None:
        app = self.app
        snapshot = getattr(app, "snapshot", None)
        title = Text(" Models ", style=theme_style(app, "primary", bold=True, reverse=True))
        serving = snapshot.model if snapshot is not None else ""
        title.append(f"  serving {serving or '—'} · enter loads the selected one · / filters · r rescans",
                     style=theme_style(app, "foreground-muted"))
        self.query_one("#models-title", Static).update(title)

    def _cells(self, c: ModelChoice) -> list[Text]:
        app = self.app
        muted = theme_style(app, "foreground-muted")
        plain = muted if not c.usable else theme_style(app, "foreground", bold=c.current)
        if c.current:
            mark, mark_style = "●", theme_style(app, "success", bold=True)
        elif not c.usable:
            mark, mark_style = "·", muted
        elif c.fits:
            mark, mark_style = "✓", theme_style(app, "success")
        else:
            mark, mark_style = "✗", theme_style(app, "error")
        if not c.usable:
            fits = Text("cannot run", style=muted)
        elif c.fits:
            fits = Text(f"fits · {c.tok_per_s:.1f} tok/s", style=theme_style(app, "success"))
        else:
            fits = Text("does not fit", style=theme_style(app, "error"))
        return [
            Text(mark, style=mark_style), Text(c.name, style=plain), Text(c.family or "?", style=plain),
            Text(c.params or "?", style=plain), Text(c.quant or "?", style=plain),
            Text(fmt_bytes(c.size_bytes), style=plain), Text(str(c.context_length or "?"), style=plain),
            fits, Text(c.where, style=muted),
        ]

    def selected(self) -> ModelChoice | None:
        name = self.query_one(ModelsTable).selected_name
        return next((c for c in self.choices or () if c.name == name), None)

    def render_detail(self) -> None:
        app = self.app
        box = self.query_one("#model-detail", Static)
        muted = theme_style(app, "foreground-muted")
        t = Text()
        if self.loading_model is not None:
            box.border_title = f"Loading {self.loading_model}"
            t.append(f"loading {self.loading_model} across the cluster", theme_style(app, "warning", bold=True))
            for node_id, (what, done, total) in sorted(self.progress.items()):
                name = app.node_name(node_id) if hasattr(app, "node_name") else node_id
                t.append(f"\n {name:<16} ", theme_style(app, "foreground", bold=True))
                if total:
                    share = done / total
                    t.append(f"{'█' * int(share * 20):<20}", theme_style(app, "success" if share >= 1 else "warning"))
                    t.append(f" {fmt_bytes(done)} / {fmt_bytes(total)}  {what}", muted)
                else:
                    t.append(what, muted)
            box.update(t)
            return
        if self.error:
            box.border_title = "Model"
            box.update(Text(f"✗ the models could not be listed: {self.error}", style=theme_style(app, "error")))
            return
        if self.choices is None:
            box.update(Text("looking for models and planning each on the cluster…", style=muted))
            return
        c = self.selected()
        if c is None:
            box.update(Text("no models found: put GGUF files in a folder of models.paths (config), or pull one "
                            "with Ollama or LM Studio", style=muted))
            return
        box.border_title = c.name
        t.append(f"{c.source}  ", muted)
        t.append(c.where, theme_style(app, "foreground"))
        if c.current:
            t.append("\n● the cluster serves this file now", theme_style(app, "success"))
        if not c.usable:
            t.append(f"\n· cannot run: {c.reason}", theme_style(app, "warning"))
        elif c.fits:
            t.append(f"\n✓ the cluster can hold it now: predicted {c.tok_per_s:.1f} tok/s (enter shows the plan)",
                     theme_style(app, "success"))
        else:
            t.append(f"\n✗ does not fit now: {c.fit_reason}", theme_style(app, "error"))
        box.update(t)

    def on_load_event(self, event: ev.Event) -> None:
        """A node's load progress (ShardProgress, NodeStateChanged) while a model loads from here."""
        if self.loading_model is None:
            return
        if isinstance(event, ev.ShardProgress):
            self.progress[event.node_id] = (f"layers {event.start}–{event.end - 1}", event.done_bytes, event.total_bytes)
        elif isinstance(event, ev.NodeStateChanged) and event.state == "loading":
            self.progress[event.node_id] = (f"loading {event.reason}".strip(), 0, 0)
        self.render_detail()

    def load_started(self, name: str) -> None:
        self.loading_model, self.progress = name, {}
        self.render_detail()

    def load_finished(self, error: str = "") -> None:
        """The load ended without the switch (the app shows ``error``): the list again, planned afresh."""
        self.loading_model = None
        self.action_reload()

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.render_detail()

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_choose()

    # ------------------------------------------------------------------ actions

    def action_choose(self) -> None:
        c = self.selected()
        if c is None:
            self.notify("No model selected.", severity="warning")
            return
        if getattr(self.app, "readonly", False):
            self.notify("Read-only console: changing the model is off.", severity="warning")
            return
        if not c.usable:
            self.notify(f"{c.name} cannot run here: {c.reason}", title="Model", severity="warning", timeout=10)
            return
        if self.loading_model is not None:
            self.notify(f"{self.loading_model} is loading: wait for it to finish.", severity="warning")
            return
        exo_app(self).request_change("model", (c.name,))

    def refilter(self) -> None:
        self.render_all()
