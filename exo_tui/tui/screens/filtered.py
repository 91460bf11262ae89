"""What the hosts view and the model picker share: a table of keyed rows under a ``/`` filter box."""

from __future__ import annotations

from textual import on
from textual.screen import Screen
from textual.widgets import DataTable, Input

from exo_tui.tui.widgets.tables import selected_row_key


class KeyedTable(DataTable):
    """A row-cursor table whose columns are ``COLUMNS`` (key, label) and whose rows have keys."""

    COLUMNS: tuple[tuple[str, str], ...] = ()

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)
        # Its columns from the start: the screen may render rows into it before its own on_mount
        # runs (a loaded machine: "More values provided than there are columns").
        for key, label in self.COLUMNS:
            self.add_column(label, key=key)

    @property
    def selected_key(self) -> str | None:
        return selected_row_key(self)


class FilteredScreen(Screen):
    """A screen with one :class:`KeyedTable` (``TABLE``) and an ``Input#filter``: ``/`` opens it,
    typing filters (``refilter``), enter goes back to the table, esc clears it, esc again leaves."""

    TABLE: type[KeyedTable] = KeyedTable
    DANGEROUS: frozenset[str] = frozenset()

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""

    def refilter(self) -> None:
        """Show the rows that match ``filter_text``."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.DANGEROUS and getattr(self.app, "readonly", False):
            return False
        if action == "filter" and isinstance(self.focused, Input):
            return False  # a '/' typed into the filter is just a '/'
        return True

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.refilter()

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(self.TABLE).focus()

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if self.focused is box:
            box.value = ""
            box.display = False
            self.query_one(self.TABLE).focus()
            return
        self.app.pop_screen()
