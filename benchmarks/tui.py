"""The console's responsiveness: key press to screen, and CPU when idle.

The app runs headless (Textual's test driver: everything but the terminal write) over an
in-process cluster of 20 nodes whose metrics change every second, so the nodes table, header and
partition bar re-render every second. Rows, measured side by side in one run:

* ``idle``: nothing streaming; the baseline;
* ``chat streaming``: a chat streams at full speed (200 tokens/s by default, ``--token-s``; one
  long answer after another) while the keys are pressed;
* ``idle, strip (M)``: idle, with the cluster strip shown (its figures and sparklines change every
  second: more than a real idle coordinator's, whose figures stay put);

and the strip's own cost, idle: the app's CPU with the strip shown less hidden, alternately in one
app (``--strip-rounds`` of each, medians), against its 1 % target.
* ``paused (Z)``: refresh paused, the floor.

Columns: key press to screen (the press delivered and every widget's resulting update and repaint
done) for ``down`` in the nodes table, median and p95, with the ratio to the 100 ms target; ``D``
to the drain confirmation on screen (a preview worker round trip); and the app process's CPU use
over 10 s without keys, as a fraction of one core, with the ratio to the 5 % target.

    .venv/bin/python benchmarks/tui.py [--seconds 10] [--presses 60] [--token-s 0.005] [--scenarios idle,...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual import events  # noqa: E402

from benchmarks.quick import parse  # noqa: E402
from exo_tui.cluster.view import ChatParams  # noqa: E402
from exo_tui.tui.app import ExoApp  # noqa: E402
from exo_tui.tui.screens.dialogs import ConfirmChange  # noqa: E402
from exo_tui.tui.widgets.chat import ChatPane  # noqa: E402
from exo_tui.tui.widgets.cluster_strip import ClusterStrip  # noqa: E402
from exo_tui.tui.widgets.nodes import NodesTable  # noqa: E402
from tests.tui.fake_cluster import REPLY, FakeCluster  # noqa: E402

KEY_TARGET_S = 0.100


async def _until(predicate, what: str, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.perf_counter() + timeout_s
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.0005)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
CPU_TARGET = 0.05
STRIP_CPU_TARGET = 0.01


def _live_figures(cluster: FakeCluster) -> None:
    """The cluster's measured figures change with every tick, as a coordinator's do (its
    sparklines take a sample a second)."""
    snapshot = cluster.snapshot

    def live() -> object:
        snap = snapshot()
        f, k = snap.metrics, getattr(cluster, "tick", 0)
        series = {name: v[k % len(v):] + v[: k % len(v)] for name, v in f.series.items()}
        figures = dataclasses.replace(f, series=series, tok_per_s=f.tok_per_s + k % 3, ttft_p50_s=0.1 + 0.001 * (k % 7))
        return dataclasses.replace(snap, metrics=figures)

    cluster.snapshot = live  # type: ignore[method-assign]


async def _tick_metrics(cluster: FakeCluster) -> None:
    """Every node's live metrics change once a second."""
    k = 0
    while True:
        await asyncio.sleep(1.0)
        k += 1
        cluster.tick = k  # type: ignore[attr-defined]
        for node_id, n in list(cluster.nodes.items()):
            cluster.nodes[node_id] = dataclasses.replace(
                n,
                cpu_percent=float((k * 13 + hash(node_id)) % 100),
                memory_used_bytes=int(n.memory_total_bytes * (0.3 + ((k + len(node_id)) % 5) / 10)),
                heartbeat_age_s=0.1 * (k % 10),
                tok_per_s=20.0 + k % 7,
                history={"cpu_percent": tuple(float((k + j) % 100) for j in range(30))},
            )


async def _stream_forever(app: ExoApp, stop: asyncio.Event) -> None:
    chat = app.main_screen.query_one(ChatPane)
    chat.params = ChatParams(max_tokens=10_000)
    while not stop.is_set():
        await chat.action_clear()  # a fresh answer each time: the log does not grow without end
        worker = await chat.send("stream")
        while not worker.is_finished and not stop.is_set():
            await asyncio.sleep(0.1)
    chat.action_stop()


async def _measure(scenario: str, args: argparse.Namespace) -> dict[str, float]:
    cluster = FakeCluster(n_nodes=20, n_layers=30, chat_delay_s=args.token_s, reply=REPLY * 80)
    _live_figures(cluster)
    app = ExoApp(cluster, refresh_s=1.0)
    result: dict[str, float] = {}
    async with app.run_test(size=(160, 50)) as pilot:
        while app.main_screen is None or app.main_screen.query_one(NodesTable).row_count < 20:
            await pilot.pause(0.05)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_tick_metrics(cluster))]
        if scenario == "chat streaming":
            tasks.append(asyncio.create_task(_stream_forever(app, stop)))
        if scenario == "paused (Z)":
            await pilot.press("Z")
        if scenario == "idle, strip (M)":
            await pilot.press("M")
        # from here on no pilot.pause()/press(): they wait for an idle screen, which never comes while streaming
        await asyncio.sleep(1.0)
        table = app.main_screen.query_one(NodesTable)
        table.focus()
        await asyncio.sleep(0.1)
        _progress(f"{scenario}: keys")
        displays: list[tuple[float, int]] = []  # (when, the cursor row it showed)
        display = app._display

        def recording_display(screen, renderable):  # noqa: ANN001
            if renderable is not None:
                displays.append((time.perf_counter(), table.cursor_row))
            return display(screen, renderable)

        app._display = recording_display  # type: ignore[method-assign]
        lat = []
        for i in range(args.presses):
            key = "down" if (i // 19) % 2 == 0 else "up"
            expected = table.cursor_row + (1 if key == "down" else -1)
            event = events.Key(key, None)
            event.set_sender(app)
            t0 = time.perf_counter()
            app._driver.send_message(event)
            shown = lambda: next((t for t, row in displays if t >= t0 and row == expected), None)  # noqa: B023, E731
            await _until(lambda: shown() is not None, f"the screen to show the cursor moved ({key})")  # noqa: B023
            lat.append(shown() - t0)
            displays.clear()
            await asyncio.sleep(0.05)
        app._display = display  # type: ignore[method-assign]
        _progress(f"{scenario}: drain confirmation")
        confirm = []
        for _ in range(5):
            t0 = time.perf_counter()
            for key in ("D",):
                event = events.Key(key, key)
                event.set_sender(app)
                app._driver.send_message(event)
            await _until(
                lambda: isinstance(app.screen, ConfirmChange) and app.screen.is_mounted and app.screen.focused is not None,
                "the drain confirmation",
            )
            confirm.append(time.perf_counter() - t0)
            app.screen.dismiss(False)
            await _until(lambda: not isinstance(app.screen, ConfirmChange), "the confirmation to close")
            table.focus()
            await asyncio.sleep(0.05)
        _progress(f"{scenario}: CPU over {args.seconds:.0f} s")
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(args.seconds)
        cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
        stop.set()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        lat.sort()
        result = {
            "key_p50": statistics.median(lat),
            "key_p95": lat[int(0.95 * (len(lat) - 1))],
            "confirm_p50": statistics.median(confirm),
            "cpu": cpu,
        }
    return result


def _timed(cls: type, name: str, spent: list[float]) -> None:
    """Add the time spent in ``cls.name`` to ``spent[0]``."""
    fn = getattr(cls, name)

    def timed(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(cls, name, timed)


async def _strip_cost(args: argparse.Namespace) -> tuple[float, float, float]:
    """Median CPU (fraction of a core) idle with the strip hidden, and shown, alternately; and the
    share of a core spent in the strip's own code (its update and its widgets' renders) while shown."""
    from exo_tui.tui.widgets.cluster_strip import Spark, StripText

    spent = [0.0]
    for cls, name in ((ClusterStrip, "show"), (Spark, "render"), (StripText, "render")):
        _timed(cls, name, spent)
    own: list[float] = []
    cluster = FakeCluster(n_nodes=20, n_layers=30)
    _live_figures(cluster)
    app = ExoApp(cluster, refresh_s=1.0)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    async with app.run_test(size=(160, 50)) as pilot:
        while app.main_screen is None or app.main_screen.query_one(NodesTable).row_count < 20:
            await pilot.pause(0.05)
        ticker = asyncio.create_task(_tick_metrics(cluster))
        for i in range(2 * args.strip_rounds):
            shown = i % 2 == 1
            _progress(f"strip {'shown' if shown else 'hidden'}: CPU over {args.seconds:.0f} s")
            if app.main_screen.query_one(ClusterStrip).shown != shown:
                await pilot.press("M")
            await asyncio.sleep(1.0)
            c0, w0, s0 = time.process_time(), time.perf_counter(), spent[0]
            await asyncio.sleep(args.seconds)
            cpu[shown].append((time.process_time() - c0) / (time.perf_counter() - w0))
            if shown:
                own.append((spent[0] - s0) / (time.perf_counter() - w0))
        ticker.cancel()
    return statistics.median(cpu[False]), statistics.median(cpu[True]), statistics.median(own)


SCENARIOS = ("idle", "idle, strip (M)", "chat streaming", "paused (Z)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--presses", type=int, default=60)
    parser.add_argument(
        "--token-s",
        type=float,
        default=0.005,
        help="seconds between streamed tokens (default 0.005: 200 tok/s, faster than the default model runs here; "
        "0: as fast as the event loop hands them out)",
    )
    parser.add_argument("--strip-rounds", type=int, default=3, help="rounds of the strip hidden/shown (default 3)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of: {', '.join(SCENARIOS)}")
    args = parse(parser, seconds=0.5, presses=3, strip_rounds=1, scenarios="chat streaming")
    scenarios = args.scenarios.split(",")
    if not set(scenarios) <= set(SCENARIOS):
        parser.error(f"--scenarios takes some of: {', '.join(SCENARIOS)}")
    rows = []
    for scenario in scenarios:
        rows.append((scenario, asyncio.run(_measure(scenario, args))))
    print(f"20 nodes updating every second; {args.presses} key presses; CPU over {args.seconds:.0f} s (fraction of one core)")
    print(f"{'scenario':<17} {'key p50 ms':>10} {'key p95 ms':>10} {'p95/target':>10} {'D→confirm ms':>13} {'CPU %':>7} {'CPU/target':>10}")
    for name, r in rows:
        print(
            f"{name:<17} {r['key_p50'] * 1000:>10.1f} {r['key_p95'] * 1000:>10.1f} {r['key_p95'] / KEY_TARGET_S:>10.2f} "
            f"{r['confirm_p50'] * 1000:>13.1f} {r['cpu'] * 100:>7.1f} {r['cpu'] / CPU_TARGET:>10.2f}"
        )
    hidden, shown, own = asyncio.run(_strip_cost(args))
    strip = shown - hidden
    print(f"the cluster strip, idle, figures changing every second: app CPU {hidden * 100:.1f} % hidden, {shown * 100:.1f} % "
          f"shown (medians of {args.strip_rounds}): {strip * 100:+.2f} % of a core, {strip / STRIP_CPU_TARGET:.2f} of its "
          f"1 % target; in the strip's own code {own * 100:.2f} % ({own / STRIP_CPU_TARGET:.2f} of the target)")
    print("targets: key press to screen < 100 ms; idle CPU < 5 % of a core (the 'idle' row; 'chat streaming' includes")
    print(f"the in-process cluster producing {1 / args.token_s if args.token_s else float('inf'):.0f} tokens/s)")


if __name__ == "__main__":
    main()
