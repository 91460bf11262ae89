"""What the console's tables share."""

from __future__ import annotations

from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist


def selected_row_key(table: DataTable) -> str | None:
    """The key of the row under ``table``'s cursor; None when there is none (no rows, or the rows
    are being replaced and the cursor points past them for this moment)."""
    if not table.row_count:
        return None
    try:
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except CellDoesNotExist:
        return None
