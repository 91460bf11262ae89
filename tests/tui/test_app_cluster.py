"""Keys in, cluster out: the console over a real local cluster (node agent processes on loopback).

Each key action must change the cluster as it should: drain moves layers off the node and the
partition bar shows it; cancel changes nothing; pin survives a rebalance; rebalance applies the
diff it showed; readonly hides the dangerous keys. And a chat on the default model answers
correctly while a drain happens in the middle of the stream.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from exo_tui.config import Config
from exo_tui.tui.app import ExoApp
from exo_tui.tui.screens.dialogs import ConfirmChange
from exo_tui.tui.widgets.chat import Answer, ChatPane
from exo_tui.tui.widgets.cluster import PartitionBar
from exo_tui.tui.widgets.nodes import NodesTable
from tests.helpers.benchmarks import share_benchmarks
from tests.tui.conftest import plain, wait_until

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def local_cluster(model: Path | str, home: Path, nodes: int, strategy: str | None = "memory"):
    from exo_tui.cluster.coordinator import Coordinator

    config = Config()
    # the test machine is shared and small: a busy node must not be declared failed mid-test
    config.scheduler.fault_tolerance.heartbeat_timeout = 20
    coordinator = Coordinator(model=str(model), local_nodes=nodes, home=home, config=config, strategy=strategy)
    share_benchmarks(home)  # the nodes' start-up benchmark, once a session
    try:
        await coordinator.start()
        share_benchmarks(home)
        yield coordinator
    finally:
        await coordinator.stop()


def table(app: ExoApp) -> NodesTable:
    return app.main_screen.query_one(NodesTable)


def bar_labels(app: ExoApp) -> str:
    return app.main_screen.query_one(PartitionBar)._lines(120)[2].plain


async def select(pilot, app: ExoApp, node_id: str) -> None:  # noqa: ANN001
    t = table(app)
    t.focus()
    t.move_cursor(row=t.get_row_index(node_id))
    await pilot.pause()
    assert t.selected_node_id == node_id


async def confirm(pilot, app: ExoApp, answer: str) -> ConfirmChange:  # noqa: ANN001
    await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange), timeout=30)
    screen = app.screen
    assert app.focused.id == "cancel"  # the default is Cancel
    await pilot.press(answer)
    await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmChange))
    return screen


def layers_of(coordinator) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    plan = coordinator.snapshot().plan
    return {s.node_id: (s.start, s.end) for s in plan.shards} if plan else {}


async def test_keys_change_a_real_cluster(tiny_model: Path, tmp_path: Path) -> None:
    async with local_cluster(tiny_model, tmp_path / "home", nodes=3) as cluster:
        before = layers_of(cluster)
        assert len(before) >= 2, before
        app = ExoApp(cluster, refresh_s=0.5)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: table(app).row_count == 3, timeout=20)
            victim = next(iter(before))
            name = cluster.nodes[victim].name
            assert name in bar_labels(app)

            # cancel changes nothing
            await select(pilot, app, victim)
            await pilot.press("D")
            await confirm(pilot, app, "escape")
            assert layers_of(cluster) == before and victim not in cluster.drained

            # drain: the layers move off the node, the bar shows it
            await pilot.press("D")
            shown = await confirm(pilot, app, "y")
            assert shown.preview.moves and any(m.src == victim for m in shown.preview.moves)
            await wait_until(pilot, lambda: victim not in layers_of(cluster), timeout=60)
            app.refresh_now()
            await wait_until(pilot, lambda: name not in bar_labels(app), timeout=10)
            assert table(app).get_cell(victim, "layers").plain == "—"
            assert sum(e - s for s, e in layers_of(cluster).values()) == cluster.snapshot().plan.n_layers

            # undrain, then pin a serving node and rebalance: the pin survives and the shown diff is applied
            await pilot.press("U")
            await wait_until(pilot, lambda: victim not in cluster.drained, timeout=60)
            keeper = next(n for n in layers_of(cluster))
            pinned = layers_of(cluster)[keeper]
            await select(pilot, app, keeper)
            await pilot.press("p")
            await wait_until(pilot, lambda: keeper in cluster.pins, timeout=60)
            await pilot.press("R")
            shown = await confirm(pilot, app, "y")
            expected = {s.node_id: (s.start, s.end) for s in shown.preview.new_plan.shards} if shown.preview.new_plan else None
            await wait_until(pilot, lambda: layers_of(cluster).get(keeper) == pinned, timeout=60)
            if expected is not None:  # apply plans afresh: the same plan unless the measurements moved meanwhile
                await wait_until(pilot, lambda: set(layers_of(cluster)) <= set(expected) | {keeper}, timeout=60)
                assert sum(e - s for s, e in layers_of(cluster).values()) == cluster.snapshot().plan.n_layers
            app.refresh_now()
            await pilot.pause()
            assert "⚑" in table(app).get_cell(keeper, "layers").plain

        # read-only: the dangerous keys do nothing and are not shown
        plan_before = layers_of(cluster)
        version = cluster.snapshot().plan.version
        ro = ExoApp(cluster, readonly=True)
        async with ro.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: table(ro).row_count == 3, timeout=20)
            await pilot.press("D", "R", "p", "U")
            await pilot.pause(0.3)
            assert not isinstance(ro.screen, ConfirmChange)
            shown_actions = {b.binding.action for b in ro.screen.active_bindings.values() if b.enabled}
            assert not {"drain", "undrain", "pin", "rebalance"} & shown_actions
        assert layers_of(cluster) == plan_before and cluster.snapshot().plan.version == version


async def test_chat_answers_while_a_drain_happens(default_model_path: Path, tmp_path: Path) -> None:
    async with local_cluster(default_model_path, tmp_path / "home", nodes=2, strategy="memory") as cluster:
        assert len(layers_of(cluster)) == 2
        app = ExoApp(cluster, refresh_s=0.5)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: table(app).row_count == 2, timeout=20)
            chat = app.main_screen.query_one(ChatPane)
            # An answer far longer than the drain (a list that repeats to the token limit): the
            # test stops it once the drain is done and the answer has gone on past it, so no
            # machine is fast enough to finish it before the confirmation opens.
            chat.params = type(chat.params)(max_tokens=4000, temperature=0.0)
            await chat.send("List the capital cities of all European countries, one per line, each with a sentence "
                            "about it, starting with France.")
            await wait_until(pilot, lambda: bool(chat.query(Answer)) and len(chat.query_one(Answer).text) > 0, timeout=60)
            answer = chat.query_one(Answer)
            victim = next(iter(layers_of(cluster)))
            await select(pilot, app, victim)
            await pilot.press("D")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange), timeout=30)
            assert chat.streaming, "the answer ended before the drain"
            assert app.screen.preview.note  # it says what happens to the streaming answer
            await confirm(pilot, app, "y")
            await wait_until(pilot, lambda: victim not in layers_of(cluster), timeout=60)
            after_drain = len(answer.text)
            await wait_until(pilot, lambda: len(answer.text) > after_drain + 40 or not chat.streaming, timeout=60)
            assert chat.streaming, "the answer ended at the drain instead of going on"
            chat.action_stop()
            await wait_until(pilot, lambda: not chat.streaming, timeout=30)
            assert "Paris" in answer.text, answer.text
            assert "✗" not in plain(answer.status) and "stopped" in plain(answer.status)
