"""The cluster strip (``M``): the cluster's measured figures at a glance, and their sparklines.

Two lines of figures — resource use, requests running and queued, outcomes and the success rate,
TTFT and inter-token latency, the ring's split of a token (compute, links, coordinator) and the
load balance — and sparklines of tokens/s, TTFT and the queue's depth over the last minutes
(:class:`~exo_tui.cluster.figures.ClusterFigures`). A figure not measured yet shows ``—``.
The strip re-renders only when its figures changed: idle, it costs the console nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.style import Style
from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget

from exo_tui.cluster.figures import ClusterFigures, NodeFigures
from exo_tui.tui.format import fmt_bytes, fmt_rate
from exo_tui.tui.widgets.style import theme_style

SPARKS = (("tok_per_s", "tok/s"), ("ttft_s", "TTFT"), ("queue_depth", "queued"))


def fmt_ms(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"


def fmt_share(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f}%"


def figure_lines(app: App[Any], f: ClusterFigures, names: dict[str, str]) -> list[list[Text]]:
    """The strip's figures: two rows of (label, value) items."""
    muted = theme_style(app, "foreground-muted")
    plain = theme_style(app, "foreground")
    rows: list[list[Text]] = [[]]

    def item(label: str, value: str, style: Style = plain) -> None:
        t = Text()
        t.append(f"{label} ", muted)
        t.append(value, style)
        rows[-1].append(t)

    item("mem", f"{fmt_bytes(f.memory_used_bytes)}/{fmt_bytes(f.memory_total_bytes)}")
    item("cpu", "—" if f.cpu_percent is None else f"{f.cpu_percent:.0f}%")
    if f.vram_total_bytes:
        item("vram", f"{fmt_bytes(f.vram_used_bytes or 0)}/{fmt_bytes(f.vram_total_bytes)}")
    item("running", str(f.running))
    item("queued", str(f.queued), theme_style(app, "warning") if f.queued else plain)
    item("tok/s", fmt_rate(f.tok_per_s))
    outcomes = f"{f.completed}✓ {f.failed}✗ {f.cancelled}⊘ {f.rejected}↩"
    item(f"last {f.window_s:.0f}s", outcomes)
    ok = f.success_rate is None or f.success_rate >= 0.99
    item("success", fmt_share(f.success_rate), theme_style(app, "success" if ok else "error", bold=not ok))
    if f.draft_acceptance is not None:
        item("drafts kept", fmt_share(f.draft_acceptance))
    rows.append([])
    item("TTFT p50/p95", f"{fmt_ms(f.ttft_p50_s)}/{fmt_ms(f.ttft_p95_s)}")
    item("ITL p50/p95", f"{fmt_ms(f.itl_p50_s)}/{fmt_ms(f.itl_p95_s)}")
    item("wait p95", fmt_ms(f.queue_wait_p95_s))
    if f.token_s is not None:
        item("token", fmt_ms(f.token_s))
        compute = [n for n in f.nodes if n.stage_s is not None]
        item("compute", " ".join(f"{names.get(n.node_id, n.name)} {fmt_share(n.token_share)}" for n in compute) or "—")
        item("links", fmt_share(f.comm_share))
        item("coord", fmt_ms(f.coordinator_s))
    bad = f.balance is not None and f.balance > 0.3
    item("balance", "—" if f.balance is None else f"{f.balance:.2f}", theme_style(app, "warning" if bad else "foreground"))
    return rows


def lay_out(rows: list[list[Text]], width: int) -> list[Text]:
    """Rows of items, each row's items two spaces apart, wrapped between items to ``width``
    (cheap: no Rich wrapping, which cost the strip more than all else)."""
    lines: list[Text] = []
    for row in rows:
        line = Text()
        for item in row:
            if line.cell_len and line.cell_len + 2 + item.cell_len > width:
                lines.append(line)
                line = Text()
            if line.cell_len:
                line.append("  ")
            line.append_text(item)
        lines.append(line)
    return lines


class StripText(Widget):
    """Rows of items that repaint without a layout pass unless their line count changes (a
    ``Static``'s update lays the whole screen out again: the strip's cost, every second)."""

    DEFAULT_CSS = "StripText { height: auto; }"

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id, classes=classes)
        self.rows: list[list[Text]] = []

    @property
    def text(self) -> Text:
        return Text("\n").join(lay_out(self.rows, self.content_size.width or 10_000))

    def set(self, rows: list[list[Text]] | Text) -> None:
        rows = [[rows]] if isinstance(rows, Text) else rows
        if rows == self.rows:
            return
        width = self.content_size.width or 80
        relayout = len(lay_out(self.rows, width)) != len(lay_out(rows, width))
        self.rows = rows
        self.refresh(layout=relayout)

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(lay_out(self.rows, width))

    def render(self) -> Text:
        return Text("\n").join(lay_out(self.rows, self.content_size.width or 80))


BLOCKS = " ▁▂▃▄▅▆▇█"


def spark_rows(values: list[float], width: int) -> tuple[str, str]:
    """Two rows of block characters, one column per bucket of ``values`` (its max), scaled to the
    largest: sixteen levels, the newest at the right."""
    width = max(1, width)
    if not values:
        return " " * width, " " * width
    n = len(values)
    cols = min(width, n)
    buckets = [max(values[i * n // cols: max(i * n // cols + 1, (i + 1) * n // cols)]) for i in range(cols)]
    top = max(buckets) or 1.0
    levels = [round(16 * max(0.0, b) / top) for b in buckets]
    low = "".join(BLOCKS[min(lv, 8)] for lv in levels)
    high = "".join(BLOCKS[max(0, lv - 8)] for lv in levels)
    return high.rjust(width), low.rjust(width)


class Spark(Widget):
    """A two-row sparkline drawn as text: it repaints without the gradient work of Textual's
    ``Sparkline`` (which cost the strip most of its time, idle)."""

    DEFAULT_CSS = "Spark { height: 2; color: $primary; }"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.data: list[float] = []

    def set(self, data: list[float]) -> None:
        if data != self.data:
            self.data = data
            self.refresh()

    def render(self) -> Text:
        high, low = spark_rows(self.data, self.content_size.width or 40)
        return Text(f"{high}\n{low}")


class ClusterStrip(Vertical):
    """Hidden until ``M``; ``show`` takes each snapshot's figures."""

    DEFAULT_CSS = """
    ClusterStrip { height: auto; display: none; padding: 0 1; border: round $foreground 25%; }
    ClusterStrip.-shown { display: block; }
    ClusterStrip #strip-sparks { height: 3; }
    ClusterStrip .strip-spark { width: 1fr; padding: 0 1 0 0; }
    ClusterStrip .strip-spark StripText { color: $foreground-muted; }
    """

    _last: tuple[object, ...] | None = None

    def compose(self) -> ComposeResult:
        yield StripText(id="strip-figures")
        with Horizontal(id="strip-sparks"):
            for key, _ in SPARKS:
                with Vertical(classes="strip-spark"):
                    yield StripText(id=f"strip-{key}-label")
                    yield Spark(id=f"strip-{key}")

    def on_mount(self) -> None:
        self.border_title = "Cluster · measured"

    @property
    def shown(self) -> bool:
        return self.has_class("-shown")

    def toggle(self) -> None:
        self.set_class(not self.shown, "-shown")
        self._last = None

    def restyle(self) -> None:
        self._last = None

    def show(self, figures: ClusterFigures | None, names: dict[str, str]) -> None:
        if not self.shown:
            return
        # the figures without their sparklines' samples: those change every second, the rest rarely when idle
        key = (None if figures is None else dataclasses.replace(figures, series={}), tuple(sorted(names.items())))
        box = self.query_one("#strip-figures", StripText)
        if figures is None:
            box.set(Text("no figures yet: the coordinator has measured nothing", style=theme_style(self.app, "foreground-muted")))
            self._last = key
            return
        if key != self._last:
            self._last = key
            box.set(figure_lines(self.app, figures, names))
        n = max((len(v) for v in figures.series.values()), default=0)
        subtitle = f"sparklines: last {n // 60} min" if n >= 60 else f"sparklines: last {n} s"
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle
        for k, label in SPARKS:
            values = list(figures.series.get(k, ()))
            last = values[-1] if values else None
            now = "—" if last is None else (fmt_ms(last) if k == "ttft_s" else f"{last:.1f}" if k == "tok_per_s" else f"{last:.0f}")
            self.query_one(f"#strip-{k}-label", StripText).set(Text(f"{label} {now}"))
            self.query_one(f"#strip-{k}", Spark).set(values)


def node_lines(app: App[Any], f: ClusterFigures | None, node_id: str, names: dict[str, str]) -> Text:
    """A node's measured figures, for its detail view: its stage and share of each token,
    sensors, and its links' probes."""
    muted = theme_style(app, "foreground-muted")
    plain = theme_style(app, "foreground")
    n: NodeFigures | None = f.node(node_id) if f is not None else None
    t = Text()
    if n is None:
        t.append("nothing measured yet", muted)
        return t

    def row(label: str, value: str) -> None:
        t.append(f"{label:<20}", muted)
        t.append(f"{value}\n", plain)

    row("stage (measured)", f"{fmt_ms(n.stage_s)} a token over {n.steps} steps")
    row("stage (its own)", fmt_ms(n.own_stage_s))
    row("queue", fmt_ms(n.queue_s))
    row("share of a token", fmt_share(n.token_share))
    row("idle", fmt_share(n.idle_share))
    if n.vram_total_bytes:
        row("vram", f"{fmt_bytes(n.vram_used_bytes or 0)}/{fmt_bytes(n.vram_total_bytes)}")
    row("temperature", "—" if n.temperature_c is None else f"{n.temperature_c:.0f} °C")
    row("power", "—" if n.power_w is None else f"{n.power_w:.1f} W")
    for x in f.links if f is not None else ():
        if node_id not in (x.src, x.dst) or (x.rtt_s is None and x.ring_s is None):
            continue
        other = x.dst if x.src == node_id else x.src
        arrow = "→" if x.src == node_id else "←"
        parts = [f"per token {fmt_ms(x.ring_s)}"] if x.ring_s is not None else []
        if x.rtt_s is not None:
            parts.append(f"rtt {fmt_ms(x.rtt_s)} · loss {fmt_share(x.loss)}")
        row(f"link {arrow} {names.get(other, other)}"[:19], " · ".join(parts))
    t.rstrip()
    return t


def measured_vs_predicted(app: App[Any], snapshot: object) -> Text:
    """`` · measured X tok/s`` beside a plan's prediction: the scheduler's accuracy, live."""
    f: ClusterFigures | None = getattr(snapshot, "metrics", None)
    plan = getattr(snapshot, "plan", None)
    t = Text()
    if f is None or plan is None or f.plan_version != plan.version or f.measured_tok_per_s is None:
        return t
    t.append(" · measured ", theme_style(app, "foreground-muted"))
    ratio = f.measured_tok_per_s / plan.predicted_tok_per_s if plan.predicted_tok_per_s else None
    good = ratio is not None and ratio >= 0.8
    t.append(f"{f.measured_tok_per_s:.1f} tok/s", theme_style(app, "success" if good else "warning", bold=True))
    if ratio is not None:
        t.append(f" ({ratio * 100:.0f}%)", theme_style(app, "foreground-muted"))
    remeasured = getattr(f, "remeasured_tok_per_s", None)
    if not good and remeasured:  # the gap: what the plan predicts on the measured figures
        t.append(f" · on measured figures {remeasured:.1f} tok/s", theme_style(app, "foreground-muted"))
    return t
