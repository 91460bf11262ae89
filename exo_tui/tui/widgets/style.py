"""Rich styles resolved from the current theme's variables (widgets never name a colour)."""

from __future__ import annotations

from rich.style import Style
from textual.app import App
from textual.color import Color, ColorParseError


def theme_color(app: App, var: str) -> Color:
    variables = app.theme_variables or app.get_css_variables()
    value = variables.get(var) or variables.get("foreground", "white")
    try:
        color = Color.parse(value)
    except ColorParseError:  # a variable like "auto 60%": fall back to the muted foreground
        color = Color.parse(variables.get("foreground-muted", variables.get("foreground", "white")))
    if color.a < 1:
        color = Color.parse(variables.get("background", "black")) + color
    return color


def theme_style(app: App, var: str, *, bold: bool = False, reverse: bool = False, italic: bool = False) -> Style:
    return Style(color=theme_color(app, var).rich_color, bold=bold, reverse=reverse, italic=italic)
