"""The cluster strip (``M``): its key in help, palette and ``:`` commands, and live figures from a
real local cluster while a chat streams (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo_tui.tui import keymap
from exo_tui.tui.app import ExoApp
from exo_tui.tui.widgets.chat import Answer, ChatPane
from exo_tui.tui.widgets.cluster import PartitionBar
from exo_tui.tui.widgets.cluster_strip import ClusterStrip, Spark, StripText
from exo_tui.tui.widgets.nodes import NodesTable
from tests.tui.conftest import wait_until
from tests.tui.test_app_cluster import local_cluster


def strip(app: ExoApp) -> ClusterStrip:
    return app.main_screen.query_one(ClusterStrip)


def test_the_key_is_in_help_and_the_palette() -> None:
    assert ("M", "Metrics") in [(k, d) for k, d, _ in keymap.help_rows("nodes")]
    assert "metrics" in keymap.command_names(readonly=True)


async def test_key_and_command_toggle_the_strip(make_app) -> None:  # noqa: ANN001
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.main_screen.query_one(NodesTable).row_count == 3)
        assert not strip(app).display
        await pilot.press("M")
        await wait_until(pilot, lambda: strip(app).display)
        text = app.main_screen.query_one("#strip-figures", StripText).text.plain
        assert "14✓ 0✗ 1⊘ 0↩" in text and "TTFT p50/p95 112 ms/180 ms" in text and "balance 0.21" in text
        assert len(app.main_screen.query_one("#strip-tok_per_s", Spark).data) == 90
        commands = [c.title for c in app.get_system_commands(app.screen)]
        assert ":metrics" in commands
        await pilot.press("colon", *"metrics", "enter")
        await wait_until(pilot, lambda: not strip(app).display)


@pytest.mark.slow
async def test_live_figures_while_a_chat_streams(tiny_model: Path, tmp_path: Path) -> None:
    async with local_cluster(tiny_model, tmp_path / "home", nodes=2, strategy="memory") as cluster:
        app = ExoApp(cluster, refresh_s=0.5)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: app.main_screen.query_one(NodesTable).row_count == 2, timeout=20)
            await pilot.press("M")
            figures = app.main_screen.query_one("#strip-figures", StripText)
            await wait_until(pilot, lambda: "0✓" in figures.text.plain, timeout=10)
            chat = app.main_screen.query_one(ChatPane)
            chat.params = type(chat.params)(max_tokens=30, temperature=0.0)
            await chat.send("Count to ten.")
            await wait_until(pilot, lambda: bool(chat.query(Answer)) and not chat.streaming, timeout=120)
            await wait_until(pilot, lambda: "1✓" in figures.text.plain, timeout=10)
            text = figures.text.plain
            assert "TTFT p50/p95 —" not in text and "ITL p50/p95 —" not in text, text
            assert "token " in text and "links " in text  # the ring's split of a token
            names = [n.name for n in cluster.snapshot().nodes]
            assert all(name in text for name in names), text  # each node's share of a token
            spark = app.main_screen.query_one("#strip-tok_per_s", Spark)
            # the answer's tokens reach the tok/s sparkline at its next once-a-second sample
            await wait_until(pilot, lambda: max(spark.data, default=0) > 0, timeout=10)
            bar = app.main_screen.query_one(PartitionBar)._lines(120)[0].plain
            assert "predicted" in bar and "measured" in bar, bar
