"""Plain text helpers of the console: units, ages, glyphs and the state -> theme-variable map."""

from __future__ import annotations

import time

# Glyphs say the state without colour; the colour is a theme variable name.
STATE_GLYPH = {
    "ready": "●",
    "loading": "◐",
    "suspect": "◔",
    "draining": "◒",
    "drained": "○",
    "failed": "✗",
    "foreign": "◇",
    "discovered": "◌",
}
STATE_COLOR_VAR = {
    "ready": "success",
    "loading": "warning",
    "suspect": "warning",
    "draining": "accent",
    "drained": "text-muted",
    "failed": "error",
    "foreign": "secondary",
    "discovered": "primary",
}
HOST_STATE_GLYPH = {"new": "◌", "bootstrapping": "◐", "node": "●", "failed": "✗"}
HOST_STATE_COLOR_VAR = {"new": "primary", "bootstrapping": "warning", "node": "success", "failed": "error"}
STEP_GLYPH = {"running": "…", "ok": "✓", "failed": "✗"}
STEP_COLOR_VAR = {"running": "warning", "ok": "success", "failed": "error"}
# Node colours of the partition bar, in plan order (theme variables).
NODE_COLOR_VARS = ("primary", "secondary", "accent", "success", "warning", "error")


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_seconds(s: float) -> str:
    """A duration with its unit, three significant digits: 182 µs, 1.45 ms, 2.10 s."""
    a = abs(s)
    if a == 0:
        return "0 s"
    if a < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if a < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def fmt_mem(used: int, total: int) -> str:
    if not total:
        return "—"
    return f"{used / 1e9:.1f}/{total / 1e9:.1f}G"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def fmt_rate(tok_per_s: float) -> str:
    return f"{tok_per_s:.1f}" if tok_per_s else "—"


def fmt_layers(layers: tuple[int, int] | None) -> str:
    if not layers:
        return "—"
    start, end = layers
    return f"{start}–{end - 1}" if end - start > 1 else f"{start}"


def fmt_clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
