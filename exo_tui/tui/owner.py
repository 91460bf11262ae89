"""The console app a widget or screen is mounted in, typed: widgets call its methods (run a
command, ask for a plan change, open a node's details) and read its control."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.dom import DOMNode

if TYPE_CHECKING:
    from exo_tui.tui.app import ExoApp


def exo_app(node: DOMNode) -> ExoApp:
    """``node.app``, the :class:`~exo_tui.tui.app.ExoApp` every widget of the console lives in."""
    from exo_tui.tui.app import ExoApp  # here: the app module imports the widgets

    app = node.app
    if not isinstance(app, ExoApp):
        raise TypeError(f"{type(node).__name__} is mounted in a {type(app).__name__}, not the exo-tui console")
    return app
