"""Header line, ring topology and partition bar."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static

from exo_tui.cluster.view import ClusterSnapshot
from exo_tui.tui.format import NODE_COLOR_VARS, fmt_age, fmt_bytes, fmt_layers, fmt_rate
from exo_tui.tui.widgets.cluster_strip import measured_vs_predicted
from exo_tui.tui.widgets.style import theme_style


class ClusterHeader(Static):
    """Cluster name, model, nodes ready/total, tok/s, plan version, time since the last update."""

    compact = False  # narrow terminals: labels left out
    _last: Text | None = None

    def restyle(self) -> None:
        self._last = None

    def show(self, snapshot: ClusterSnapshot | None, *, now: float, paused: bool, readonly: bool) -> None:
        app = self.app
        t = Text(no_wrap=False, overflow="fold")
        t.append(" exo-tui ", theme_style(app, "primary", bold=True, reverse=True))
        if snapshot is None:
            t.append("  waiting for the coordinator…", theme_style(app, "warning"))
            self.update(t)
            return
        sep = (" │ " if self.compact else "  │ ", theme_style(app, "foreground-muted"))
        t.append(f" {snapshot.name}", theme_style(app, "foreground", bold=True))
        t.append(*sep)
        if not self.compact:
            t.append("model ", theme_style(app, "foreground-muted"))
        t.append(snapshot.model or "—", theme_style(app, "secondary", bold=True))
        t.append(*sep)
        total = len(snapshot.nodes)
        ready = snapshot.ready_count
        if not self.compact:
            t.append("nodes ", theme_style(app, "foreground-muted"))
        t.append(f"{ready}/{total} ready", theme_style(app, "success" if total and ready == total else "warning"))
        t.append(*sep)
        t.append(f"{fmt_rate(snapshot.tok_per_s)} tok/s", theme_style(app, "foreground"))
        t.append(*sep)
        q = snapshot.queue
        if q is not None and (q.queued or q.preempted or q.rejected):  # requests waiting for the nodes' memory
            t.append(f"{q.running} running · {q.queued} queued", theme_style(app, "warning" if q.queued else "foreground"))
            if q.preempted:
                t.append(f" · {q.preempted} preempted", theme_style(app, "foreground-muted"))
            if q.rejected:
                t.append(f" · {q.rejected} refused", theme_style(app, "error"))
            t.append(*sep)
        plan = (f"v{snapshot.plan.version}" if self.compact else f"plan v{snapshot.plan.version}") if snapshot.plan else "no plan"
        t.append(plan, theme_style(app, "foreground"))
        t.append(*sep)
        age = now - snapshot.updated_at if snapshot.updated_at else None
        t.append(f"{fmt_age(age)} ago" if self.compact else f"updated {fmt_age(age)} ago", theme_style(app, "foreground-muted"))
        if paused:
            t.append("  ⏸ PAUSED (Z)", theme_style(app, "warning", bold=True))
        if readonly:
            t.append("  READONLY", theme_style(app, "accent", bold=True))
        if t != self._last:
            self._last = t
            self.update(t)


def ring_order(snapshot: ClusterSnapshot) -> list[str]:
    if snapshot.plan and snapshot.plan.shards:
        return [s.node_id for s in snapshot.plan.shards]
    if snapshot.links:
        return [link.src for link in snapshot.links]
    return []


def _plan_key(snapshot: ClusterSnapshot) -> object:
    """What the partition bar and the ring draw: the plan, node names and states, links."""
    return (
        snapshot.plan,
        tuple((n.node_id, n.name, n.state) for n in snapshot.nodes),
        tuple((link.src, link.dst, None if link.latency_ms is None else round(link.latency_ms, 1), link.ok) for link in snapshot.links),
        None if snapshot.metrics is None or snapshot.metrics.measured_tok_per_s is None
        else (snapshot.metrics.plan_version, round(snapshot.metrics.measured_tok_per_s, 1)),
    )


class Topology(Static):
    """The ring in plan order with each link's measured latency; failed links in the error colour."""

    _key: object = None

    def restyle(self) -> None:
        self._key = None

    def show(self, snapshot: ClusterSnapshot) -> None:
        key = _plan_key(snapshot)
        if key == self._key:
            return
        self._key = key
        app = self.app
        names = {n.node_id: n.name for n in snapshot.nodes}
        order = ring_order(snapshot)
        t = Text()
        if not order:
            t.append("no ring yet: the plan is empty", theme_style(app, "foreground-muted"))
            self.update(t)
            return
        links = {(link.src, link.dst): link for link in snapshot.links}
        t.append("ring ", theme_style(app, "foreground-muted"))
        for i, node_id in enumerate(order):
            nxt = order[(i + 1) % len(order)]
            t.append(names.get(node_id, node_id), theme_style(app, NODE_COLOR_VARS[i % len(NODE_COLOR_VARS)], bold=True))
            if len(order) == 1:
                break
            link = links.get((node_id, nxt))
            if link is not None and not link.ok:
                t.append(" ─✗ failed→ ", theme_style(app, "error", bold=True))
            elif link is not None and link.latency_ms is not None:
                t.append(f" ─{link.latency_ms:.1f}ms→ ", theme_style(app, "foreground-muted"))
            else:
                t.append(" ─?→ ", theme_style(app, "foreground-muted"))
        if len(order) > 1:
            t.append("↺", theme_style(app, "foreground-muted"))
        self.update(t)


class PartitionBar(Widget):
    """Layers 0..L-1 coloured by node; pinned ranges flagged ⚑, draining nodes hatched ▒."""

    DEFAULT_CSS = "PartitionBar { height: auto; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._snapshot: ClusterSnapshot | None = None
        self._key: object = None
        self.compact = False  # short terminals: no legend (the labels under the bar remain)

    def show(self, snapshot: ClusterSnapshot) -> None:
        key = _plan_key(snapshot)
        self._snapshot = snapshot
        if key != self._key:  # live metrics alone do not change the bar
            self._key = key
            self.refresh(layout=True)

    def restyle(self) -> None:
        self._key = None

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self._lines(width))

    def render(self) -> Text:
        return Text("\n").join(self._lines(self.content_size.width or 80))

    def _lines(self, width: int) -> list[Text]:
        app = self.app
        snap = self._snapshot
        muted = theme_style(app, "foreground-muted")
        if snap is None or snap.plan is None or not snap.plan.shards:
            return [Text("no plan: waiting for ready nodes", style=muted)]
        plan = snap.plan
        nodes = {n.node_id: n for n in snap.nodes}
        width = max(10, width)
        n_layers = max(1, plan.n_layers)
        head = Text()
        head.append(f"layers 0–{n_layers - 1}", theme_style(app, "foreground"))
        head.append(f" · plan v{plan.version} · {plan.strategy}", muted)
        if plan.context_length:
            head.append(f" · context {plan.context_length}", muted)
        if plan.draft:
            head.append(f" · {plan.draft}", muted)
        head.append(" · predicted ", muted)
        head.append(f"{plan.predicted_tok_per_s:.1f} tok/s", theme_style(app, "success", bold=True))
        head.append_text(measured_vs_predicted(app, snap))
        if plan.predicted_ttft_s:
            head.append(f" · ttft {plan.predicted_ttft_s * 1000:.0f} ms{_for_prompt(plan.predicted_ttft_prompt_tokens)}", muted)
        bar = Text()
        labels = Text()
        index = {s.node_id: i for i, s in enumerate(plan.shards)}
        # columns per shard, proportional to layers, at least 1
        cols = [max(1, round((s.end - s.start) * width / n_layers)) for s in plan.shards]
        while sum(cols) > width and max(cols) > 1:
            cols[cols.index(max(cols))] -= 1
        if sum(cols) < width:
            cols[-1] += width - sum(cols)
        for shard, c in zip(plan.shards, cols, strict=True):
            node = nodes.get(shard.node_id)
            var = NODE_COLOR_VARS[index[shard.node_id] % len(NODE_COLOR_VARS)]
            draining = node is not None and node.state in ("draining", "drained")
            bar.append(("▒" if draining else "█") * c, theme_style(app, var))
            name = node.name if node else shard.node_id
            label = ("⚑" if shard.pinned else "") + name
            label = label[:c].ljust(c) if c > 1 else (label[:1] if c == 1 else "")
            labels.append(label, theme_style(app, var, bold=shard.pinned))
        items: list[Text] = []
        for shard in plan.shards:
            node = nodes.get(shard.node_id)
            var = NODE_COLOR_VARS[index[shard.node_id] % len(NODE_COLOR_VARS)]
            item = Text()
            item.append("■ ", theme_style(app, var))
            item.append(node.name if node else shard.node_id, theme_style(app, "foreground"))
            item.append(f" {fmt_layers((shard.start, shard.end))} ({shard.end - shard.start})", muted)
            if shard.weight_bytes:  # the shard's bytes, and what the plan counts with its caches of what the node has
                item.append(f" {fmt_bytes(shard.weight_bytes)}", theme_style(app, "foreground"))
                if shard.usable_bytes:
                    item.append(f" ({fmt_bytes(shard.memory_bytes)} with KV, of {fmt_bytes(shard.usable_bytes)})", muted)
            if shard.precision:  # the math its node runs it at (ONNX: int8 on K-quants, int16, float32)
                item.append(f" {shard.precision}", muted)
            if shard.pinned:
                item.append(" ⚑pinned", theme_style(app, "accent"))
            if node is not None and node.state in ("draining", "drained"):
                item.append(f" ▒{node.state}", theme_style(app, "warning"))
            items.append(item)
        legend_lines: list[Text] = []
        for item in items:
            if legend_lines and legend_lines[-1].cell_len + 2 + item.cell_len <= width:
                legend_lines[-1].append("  ")
                legend_lines[-1].append_text(item)
            else:
                legend_lines.append(item)
        lines = [head, bar, labels]
        if not self.compact:
            lines.extend(legend_lines)
        lines = [line for part in lines for line in part.wrap(app.console, width)]
        return lines


def _for_prompt(tokens: int) -> str:
    """Which prompt a predicted time to first token is for (it grows with the prompt)."""
    return f" @ {tokens} tok" if tokens else ""
