"""The events log: node joins and failures, plan changes with their diffs, operator actions,
bootstrap progress. High-rate events (metrics, tokens) are not logged."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.events import Resize
from textual.widgets import RichLog

from exo_tui import events as ev
from exo_tui.tui import keymap
from exo_tui.tui.format import STEP_GLYPH, fmt_bytes, fmt_clock, fmt_layers
from exo_tui.tui.widgets.style import theme_style

QUIET = (ev.NodeMetrics, ev.TokenStreamed, ev.ShardProgress)


def _moves(diff: dict[str, Any]) -> list[dict[str, Any]]:
    moves = diff.get("moves") or []
    return [m for m in moves if isinstance(m, dict)]


def describe(event: ev.Event, names: dict[str, str]) -> tuple[str, str] | None:
    """(theme variable, text) for an event, or None when it is not worth a line."""

    def name(node_id: str | None) -> str:
        if node_id is None:
            return "fresh load"
        return names.get(node_id, node_id)

    if isinstance(event, QUIET):
        return None
    if isinstance(event, ev.NodeJoined):
        return "success", f"● node joined: {event.name} at {event.address}:{event.port}"
    if isinstance(event, ev.NodeFailed):
        return "error", f"✗ node failed: {name(event.node_id)}: {event.reason}"
    if isinstance(event, ev.NodeGone):
        return "warning", f"○ node gone: {event.name or name(event.node_id)}"
    if isinstance(event, ev.NodeDiscovered):
        what = "foreign node" if event.foreign else "node"
        return "primary", f"◌ {what} discovered: {event.name} at {event.address}:{event.port} ({event.source})"
    if isinstance(event, ev.NodeStateChanged):
        var = {"failed": "error", "ready": "success", "suspect": "warning"}.get(event.state, "foreground")
        reason = f": {event.reason}" if event.reason else ""
        return var, f"• {name(event.node_id)} is {event.state}{reason}"
    if isinstance(event, ev.NodeUpdated):
        return None
    if isinstance(event, ev.PlanChanged):
        moves = _moves(event.diff)
        parts = [f"⇄ plan v{event.version}"]
        if event.reason:
            parts.append(event.reason)
        if moves:
            total = sum(int(m.get("nbytes", 0)) for m in moves)
            desc = ", ".join(
                f"{fmt_layers((int(m['start']), int(m['end'])))} {name(m.get('src'))}→{name(m.get('dst'))}"
                for m in moves[:4]
                if "start" in m and "end" in m
            )
            more = f" +{len(moves) - 4} more" if len(moves) > 4 else ""
            parts.append(f"{len(moves)} move(s), {fmt_bytes(total)}: {desc}{more}")
        elif event.diff.get("summary"):
            parts.append(str(event.diff["summary"]))
        return "secondary", ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")
    if isinstance(event, ev.OperatorAction):
        var = "success" if event.result == "ok" else "warning" if event.result == "cancelled" else "error"
        detail = f" ({event.detail})" if event.detail else ""
        return var, f"» {event.action} {name(event.target) if event.target else ''}: {event.result}{detail}"
    if isinstance(event, ev.BootstrapProgress):
        var = {"ok": "success", "failed": "error"}.get(event.status, "warning")
        msg = f": {event.message}" if event.message else ""
        return var, f"{STEP_GLYPH.get(event.status, '•')} bootstrap {event.host} {event.step} {event.status}{msg}"
    if isinstance(event, ev.HostDiscovered):
        return "primary", f"◌ host found: {event.host}:{event.port} ({event.source})"
    if isinstance(event, ev.HostGone):
        return None
    if isinstance(event, ev.RequestDone):
        if event.finish_reason == "error":
            return "error", f"✗ request {event.request_id} failed: {event.error}"
        return None
    if isinstance(event, ev.PredictionGap):  # its notice says it for the operator
        return None
    if isinstance(event, ev.Notice):
        return {"error": "error", "warning": "warning"}.get(event.level, "primary"), f"! {event.message}"
    return "foreground", f"{event.kind}"


class EventsLog(RichLog):
    ALLOW_MAXIMIZE = True
    HELP_SCOPE = "events"
    BINDINGS = keymap.bindings("events")

    def __init__(self, **kwargs) -> None:
        super().__init__(wrap=True, markup=False, max_lines=2000, auto_scroll=True, min_width=20, **kwargs)
        self.border_title = "Events"
        self._logged: list[tuple[ev.Event, dict[str, str]]] = []

    def on_resize(self, event: Resize) -> None:
        if self._logged:
            self.restyle()

    def restyle(self) -> None:
        """Write every line again in the current theme's colours."""
        logged, self._logged = self._logged, []
        self.clear()
        for event, names in logged:
            self.add_event(event, names)

    def add_event(self, event: ev.Event, names: dict[str, str]) -> bool:
        described = describe(event, names)
        if described is None:
            return False
        var, text = described
        self._logged.append((event, names))
        del self._logged[:-2000]
        line = Text()
        line.append(fmt_clock(event.ts) + " ", theme_style(self.app, "foreground-muted"))
        line.append(text, theme_style(self.app, var))
        at_end = self.scroll_y >= self.max_scroll_y - 1
        self.write(line, scroll_end=at_end)
        return True

    def action_follow(self) -> None:
        self.scroll_end(animate=False)
