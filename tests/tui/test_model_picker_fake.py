"""The model picker's keys over the FakeCluster: what it shows while a model loads (each node's
progress), where it goes after, and what read-only and unusable models refuse."""

from __future__ import annotations

import asyncio

from exo_tui.tui.screens.dialogs import ConfirmChange
from exo_tui.tui.screens.models import ModelsScreen, ModelsTable
from tests.tui.conftest import plain, wait_until
from tests.tui.fake_cluster import FakeCluster


async def open_picker(pilot, app) -> ModelsScreen:  # noqa: ANN001
    await pilot.press("m")
    await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.choices is not None)
    return app.screen


async def test_a_load_shows_each_node_s_progress_then_returns_to_the_chat(make_app, fake: FakeCluster) -> None:
    fake.model_load_step = asyncio.Event()
    app = make_app()
    async with app.run_test(size=(140, 40)) as pilot:
        picker = await open_picker(pilot, app)
        table = picker.query_one(ModelsTable)
        assert table.selected_name == "smollm2-135m"  # the cursor starts on the model served
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        assert app.screen.preview.targets == ("llama3.2:1b",) and app.screen.preview.bytes_moved > 0
        await pilot.press("y")
        await wait_until(pilot, lambda: picker.loading_model == "llama3.2:1b" and len(picker.progress) == 1)
        text = plain(picker.query_one("#model-detail"))
        assert "loading llama3.2:1b" in text and "mac-studio" in text and "134.6 MB / 269.2 MB" in text
        for _ in range(5):  # the other half of the first node, then the other two nodes
            fake.model_load_step.set()
            fake.model_load_step.clear()
            await pilot.pause(0.05)
        await wait_until(pilot, lambda: len(picker.progress) == 3
                         and all(done == total for _, done, total in picker.progress.values()))
        assert plain(picker.query_one("#model-detail")).count("269.2 MB / 269.2 MB") == 3
        fake.model_load_step.set()
        await wait_until(pilot, lambda: app.screen is app.main_screen and fake.model == "llama3.2:1b")
        app.refresh_now()
        assert app.snapshot.model == "llama3.2:1b"


async def test_what_cannot_run_or_fit_is_refused_and_read_only_changes_nothing(make_app, fake: FakeCluster) -> None:
    app = make_app()
    async with app.run_test(size=(140, 40)) as pilot:
        picker = await open_picker(pilot, app)
        table = picker.query_one(ModelsTable)
        table.move_cursor(row=table.get_row_index("qwen2.5:7b"))
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.screen is picker and any("qwen2" in n.message for n in app._notifications)
        # one that does not fit: the confirmation says why and offers only Cancel
        table.move_cursor(row=table.get_row_index("llama3.1:70b"))
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        assert "26.4 GB free" in app.screen.preview.error and not app.screen.query("#apply")
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.screen is picker)
        # the filter keeps the matching rows only; esc clears it
        await pilot.press("slash", *"tiny")
        await wait_until(pilot, lambda: table.row_count == 1)
        await pilot.press("escape")
        await wait_until(pilot, lambda: table.row_count == 6)
    ro = make_app(readonly=True)
    async with ro.run_test(size=(140, 40)) as pilot:
        await pilot.press("m")
        await pilot.pause(0.2)
        assert not isinstance(ro.screen, ModelsScreen)  # m is a dangerous key: off in read-only
        assert fake.applied == []
