"""The console's own Textual themes (data only; only :mod:`exo_tui.tui` imports this package).

Widgets never name a colour: they use the theme's variables (``$primary``, ``$success``,
``$warning``, ``$error``...). Node states map to those variables in ``exo_tui/tui/format.py``.
"""

from __future__ import annotations

from textual.theme import Theme

EXO_DARK = Theme(
    name="exo-dark",
    primary="#4FB3FF",
    secondary="#B48EFF",
    accent="#FFB454",
    warning="#F2C94C",
    error="#FF5C6C",
    success="#52D273",
    foreground="#D8DEE9",
    background="#10141B",
    surface="#171C25",
    panel="#222A36",
    dark=True,
    variables={
        "block-cursor-text-style": "bold",
        "footer-key-foreground": "#4FB3FF",
        "input-selection-background": "#4FB3FF 35%",
    },
)

EXO_LIGHT = Theme(
    name="exo-light",
    primary="#0B62C4",
    secondary="#7048C8",
    accent="#B35C00",
    warning="#A66F00",
    error="#C4283A",
    success="#1F8A3E",
    foreground="#1B2430",
    background="#F7F8FA",
    surface="#ECEFF4",
    panel="#DDE3EC",
    dark=False,
    variables={
        "block-cursor-text-style": "bold",
        "footer-key-foreground": "#0B62C4",
        "input-selection-background": "#0B62C4 25%",
    },
)

THEMES: tuple[Theme, ...] = (EXO_DARK, EXO_LIGHT)
DEFAULT_THEME = EXO_DARK.name
