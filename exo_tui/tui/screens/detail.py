"""Node detail: full profile, score breakdown by part and weight, metric sparklines, shards."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Label, Sparkline, Static

from exo_tui.cluster.view import ClusterSnapshot, NodeView
from exo_tui.tui import keymap
from exo_tui.tui.format import (
    STATE_COLOR_VAR,
    STATE_GLYPH,
    fmt_age,
    fmt_bytes,
    fmt_layers,
    fmt_mem,
    fmt_rate,
    fmt_seconds,
)
from exo_tui.tui.widgets.cluster_strip import node_lines
from exo_tui.tui.widgets.style import theme_style


def _flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key in sorted(data):
        value = data[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            rows.append((name, ", ".join(str(v) for v in value) or "—"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith("bytes_per_s"):
            rows.append((name, f"{fmt_bytes(value)}/s"))
        elif isinstance(value, float) and key.endswith("_s"):
            rows.append((name, fmt_seconds(value)))
        elif isinstance(value, float):
            rows.append((name, f"{value:,.4g}"))
        elif isinstance(value, int) and "bytes" in key:
            rows.append((name, fmt_bytes(value)))
        else:
            rows.append((name, str(value)))
    return rows


class NodeDetailScreen(Screen):
    HELP_SCOPE = "detail"
    BINDINGS = keymap.bindings("detail")

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id
        self._node: NodeView | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="detail-title")
        with VerticalScroll(id="detail-body"):
            with Horizontal(id="detail-top"):
                yield Static(id="detail-summary", classes="card")
                yield Static(id="detail-score", classes="card")
            yield Static(id="detail-measured", classes="card")
            yield Vertical(id="detail-metrics", classes="card")
            yield Static(id="detail-shards", classes="card")
            yield Static(id="detail-profile", classes="card")
        yield Footer()

    def on_mount(self) -> None:
        for wid, title in (
            ("#detail-summary", "Node"),
            ("#detail-score", "Score"),
            ("#detail-measured", "Measured"),
            ("#detail-metrics", "Metrics"),
            ("#detail-shards", "Shards"),
            ("#detail-profile", "Profile"),
        ):
            self.query_one(wid).border_title = title
        snapshot = getattr(self.app, "snapshot", None)
        if snapshot is not None:
            self.render_snapshot(snapshot)
        self.query_one("#detail-body").focus()

    def render_snapshot(self, snapshot: ClusterSnapshot, **_: object) -> None:
        node = next((n for n in snapshot.nodes if n.node_id == self.node_id), None)
        app = self.app
        title = self.query_one("#detail-title", Static)
        if node is None:
            title.update(Text(f" node {self.node_id} is no longer in the cluster (q goes back)", style=theme_style(app, "warning")))
            return
        self._node = node
        t = Text(" ")
        t.append(f"{STATE_GLYPH.get(node.state, '?')} {node.state}", theme_style(app, STATE_COLOR_VAR.get(node.state, "foreground"), bold=True))
        t.append(f"  {node.name}", theme_style(app, "foreground", bold=True))
        t.append(f"  {node.node_id}  {node.address}:{node.port}", theme_style(app, "foreground-muted"))
        title.update(t)
        self.query_one("#detail-summary", Static).update(self._summary(node))
        self.query_one("#detail-score", Static).update(self._score(node))
        self.query_one("#detail-shards", Static).update(self._shards(node, snapshot))
        self.query_one("#detail-profile", Static).update(self._profile(node))
        names = {n.node_id: n.name for n in snapshot.nodes}
        self.query_one("#detail-measured", Static).update(node_lines(app, snapshot.metrics, node.node_id, names))
        self._metrics(node)

    def _kv(self) -> Table:
        table = Table(box=None, show_header=False, padding=(0, 1), expand=True)
        table.add_column(style=theme_style(self.app, "foreground-muted"), no_wrap=True)
        table.add_column(style=theme_style(self.app, "foreground"), ratio=1)
        return table

    def _summary(self, node: NodeView) -> Table:
        table = self._kv()
        table.add_row("backend", node.backend or "—")
        table.add_row("backends", ", ".join(node.backends) or "—")
        memory = fmt_mem(node.memory_used_bytes, node.memory_total_bytes)
        if node.profile.get("memory_limit_bytes") and (baseline := node.profile.get("runtime_baseline_bytes")):
            # the limit is the models' memory (shards, KV caches); the runtime's own lies below it
            memory += f" limit (+{baseline / 1e9:.2f}G runtime)"
        table.add_row("memory", memory)
        table.add_row("cpu", f"{node.cpu_percent:.0f} %")
        table.add_row("layers", fmt_layers(node.layers) + (" (pinned)" if node.pinned else ""))
        table.add_row("tok/s", fmt_rate(node.tok_per_s))
        if node.layer_s_startup is not None or node.layer_s_measured is not None:  # start-up beside measured
            startup = fmt_seconds(node.layer_s_startup) if node.layer_s_startup is not None else "—"
            measured = fmt_seconds(node.layer_s_measured) if node.layer_s_measured is not None else "not yet"
            table.add_row("layer time", f"{measured} measured · {startup} start-up (decode, a layer)")
        table.add_row("heartbeat", fmt_age(node.heartbeat_age_s))
        table.add_row("drained", "yes" if node.drained else "no")
        return table

    def _score(self, node: NodeView) -> Table:
        app = self.app
        table = Table(box=None, show_header=True, padding=(0, 1), expand=True, header_style=theme_style(app, "foreground-muted"))
        table.add_column("part")
        table.add_column("points", justify="right")
        for part, points in sorted(node.score_breakdown.items(), key=lambda kv: -kv[1]):
            table.add_row(part, f"{points:.1f}")
        total = "—" if node.score is None else f"{node.score:.1f}"
        style = theme_style(app, "success" if node.eligible else "error", bold=True)
        table.add_row(Text("total", style=style), Text(total, style=style))
        if not node.eligible:
            table.add_row(Text(f"not eligible: {node.ineligible_reason or 'below the minimum score'}", style=theme_style(app, "error")), "")
        if node.weights:
            table.add_row(Text("weights in force", style=theme_style(app, "foreground-muted")), "")
            for group, weight in node.weights.items():
                table.add_row(f"  {group}", f"{weight:g}")
        return table

    def _shards(self, node: NodeView, snapshot: ClusterSnapshot) -> Text:
        app = self.app
        t = Text()
        shards = [s for s in (snapshot.plan.shards if snapshot.plan else ()) if s.node_id == node.node_id]
        if not shards:
            t.append("holds no layers in the current plan", theme_style(app, "foreground-muted"))
            return t
        for s in shards:
            t.append(f"layers {fmt_layers((s.start, s.end))} ({s.end - s.start})", theme_style(app, "foreground"))
            if s.experts[0]:
                t.append(f"  {s.experts[0]} experts a layer, {s.experts[1]} chosen a token", theme_style(app, "foreground"))
            if s.precision:
                t.append(f"  runs at {s.precision}", theme_style(app, "foreground"))
            if s.pinned:
                t.append("  ⚑ pinned", theme_style(app, "accent"))
            t.append(f"  plan v{snapshot.plan.version if snapshot.plan else 0}\n", theme_style(app, "foreground-muted"))
        t.rstrip()
        return t

    def _profile(self, node: NodeView) -> Table | Text:
        rows = _flatten(node.profile)
        if not rows:
            return Text("no profile reported yet", style=theme_style(self.app, "foreground-muted"))
        table = self._kv()
        for key, value in rows:
            table.add_row(key, value)
        return table

    def _metrics(self, node: NodeView) -> None:
        box = self.query_one("#detail-metrics", Vertical)
        if not node.history:
            if not box.children:
                box.mount(Label("no history yet", classes="muted"))
            return
        for metric in sorted(node.history):
            values = list(node.history[metric])
            wid = f"spark-{metric.replace('.', '-').replace('/', '-')}"
            last = f"{values[-1]:.1f}" if values else "—"
            label_text = f"{metric}  {last}  (min {min(values):.1f} · max {max(values):.1f})" if values else metric
            existing = box.query(f"#{wid}")
            if existing:
                existing.first(Sparkline).data = values
                box.query_one(f"#{wid}-label", Label).update(label_text)
            else:
                for child in box.query(".muted"):
                    child.remove()
                box.mount(Label(label_text, id=f"{wid}-label", classes="metric-label"))
                box.mount(Sparkline(values, id=wid))

    def action_back(self) -> None:
        self.app.pop_screen()
