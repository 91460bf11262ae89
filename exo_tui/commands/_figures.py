"""The cluster's measured figures as ``exo-tui status`` prints them (``--json`` has them whole,
under ``metrics``)."""

from __future__ import annotations

from typing import Any


def ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1000:.0f} ms" if x >= 0.01 else f"{x * 1000:.1f} ms"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f} %"


def print_figures(console: Any, d: dict[str, Any], names: dict[str, str]) -> None:
    """``d``: the ``metrics`` of ``GET /v1/cluster``."""
    from rich.table import Table

    if not d:
        return
    w = d.get("window_s", 60)
    gb = lambda n: "—" if n is None else f"{n / 1e9:.1f}"  # noqa: E731
    vram = f" · VRAM {gb(d.get('vram_used_bytes'))}/{gb(d.get('vram_total_bytes'))} GB" if d.get("vram_total_bytes") else ""
    cpu = "—" if d.get("cpu_percent") is None else f"{d['cpu_percent']:.0f} %"
    console.print(f"[bold]measured[/] (last {w:.0f} s) · memory {gb(d.get('memory_used_bytes'))}/{gb(d.get('memory_total_bytes'))} GB"
                  f" · CPU {cpu}{vram} · balance (std/mean) {'—' if d.get('balance') is None else format(d['balance'], '.2f')}")
    console.print(f"requests {d.get('running', 0)} running, {d.get('queued', 0)} queued · "
                  f"{d.get('completed', 0)} completed, {d.get('failed', 0)} failed, {d.get('cancelled', 0)} cancelled, "
                  f"{d.get('rejected', 0)} rejected · success {pct(d.get('success_rate'))} · {d.get('tok_per_s', 0.0):.1f} tok/s")
    console.print(f"queue wait p50 {ms(d.get('queue_wait_p50_s'))} p95 {ms(d.get('queue_wait_p95_s'))} · "
                  f"TTFT p50 {ms(d.get('ttft_p50_s'))} p95 {ms(d.get('ttft_p95_s'))} · "
                  f"inter-token p50 {ms(d.get('itl_p50_s'))} p95 {ms(d.get('itl_p95_s'))}")
    measured, predicted = d.get("measured_tok_per_s"), d.get("predicted_tok_per_s")
    if d.get("token_s") is not None:
        console.print(f"ring: a token {ms(d['token_s'])} · coordinator {ms(d.get('coordinator_s'))} · links "
                      f"{pct(d.get('comm_share'))} · one stream {measured or 0:.1f} tok/s measured, "
                      f"{predicted or 0:.1f} predicted")
    t = Table(title="nodes, measured", title_justify="left")
    for col in ("node", "stage", "queue", "share of a token", "idle", "temp", "power"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for n in d.get("nodes", []):
        temp = "—" if n.get("temperature_c") is None else f"{n['temperature_c']:.0f} °C"
        power = "—" if n.get("power_w") is None else f"{n['power_w']:.1f} W"
        t.add_row(n["name"], ms(n.get("stage_s")), ms(n.get("queue_s")), pct(n.get("token_share")),
                  pct(n.get("idle_share")), temp, power)
    console.print(t)
    links = [x for x in d.get("links", []) if x.get("ring_s") is not None or x.get("rtt_s") is not None]
    if links:
        lt = Table(title="links", title_justify="left")
        for col in ("link", "per token", "probe RTT", "loss"):
            lt.add_column(col, justify="left" if col == "link" else "right")
        for x in links:
            lt.add_row(f"{names.get(x['src'], x['src'])} → {names.get(x['dst'], x['dst'])}", ms(x.get("ring_s")),
                       ms(x.get("rtt_s")), pct(x.get("loss")))
        console.print(lt)
