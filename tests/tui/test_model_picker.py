"""The model picker over a real local cluster and a test store (tests/model_store.py) in a temporary
HOME: it lists the store, marks what does not fit and what cannot run, switches the model after a
confirmation that shows the plan diff, and a chat then answers from the new model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from exo_tui.config import Config
from exo_tui.tui.app import ExoApp
from exo_tui.tui.screens.dialogs import ConfirmChange
from exo_tui.tui.screens.models import ModelsScreen, ModelsTable
from exo_tui.tui.widgets.chat import Answer, ChatPane
from tests.factory import write_tiny_llama
from tests.helpers.benchmarks import share_benchmarks
from tests.model_store import build_store
from tests.tui.conftest import plain, wait_until

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def cluster_on(model: str, home: Path, paths: list[str]):
    from exo_tui.cluster.coordinator import Coordinator

    config = Config()
    config.scheduler.fault_tolerance.heartbeat_timeout = 20
    config.models.paths = paths
    config.models.context_length = 0  # every model at its own context: the huge-context one cannot fit
    coordinator = Coordinator(model=model, local_nodes=1, home=home, config=config, persist=False)
    share_benchmarks(home)  # the node's start-up benchmark, once a session
    try:
        await coordinator.start()
        share_benchmarks(home)
        yield coordinator
    finally:
        await coordinator.stop()


def row(app: ExoApp, name: str) -> list[str]:
    table = app.screen.query_one(ModelsTable)
    return [c.plain for c in table.get_row(name)]


async def test_the_picker_lists_the_store_and_switches_the_model(default_model_path: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = build_store(tmp_path, default_model_path)
    # a tiny file whose KV caches at its full context would take about a terabyte: it cannot fit
    write_tiny_llama(store.folder / "huge-context.gguf", context_length=2_000_000_000, seed=6)
    for key in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("EXO_TUI_CACHE", store.cache)  # the node process builds no kernel under the store's HOME
    monkeypatch.setenv("HOME", str(store.home))
    async with cluster_on("someone/tiny:q8", tmp_path / "exo", [str(store.folder)]) as cluster:
        app = ExoApp(cluster, refresh_s=0.5)
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.press("m")
            await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.choices is not None,
                             timeout=120)
            picker = app.screen
            names = {c.name for c in picker.choices}
            assert {"smollm2:135m", "someone/tiny:q8", "SmolLM2-135M-Instruct-Q4_1-lms", "smollm2-135m-instruct-q4_1-hf",
                    "tiny-split", "truncated", "broken:latest", "huge-context"} <= names
            current = row(app, "someone/tiny:q8")
            assert current[0] == "●" and current[2:5] == ["llama", "165K", "Q8_0"]
            smol = row(app, "smollm2:135m")
            assert smol[0] == "✓" and smol[2:5] == ["llama", "135M", "Q4_1"] and smol[7].startswith("fits · ")
            assert float(smol[7].split("·")[1].split()[0]) > 0  # its predicted tok/s
            huge = row(app, "huge-context")
            assert huge[0] == "✗" and huge[7] == "does not fit"
            for name in ("truncated", "broken:latest", "tiny-split"):
                assert row(app, name)[7] == "cannot run", name
            # the highlighted one's reason shows below the table
            table = app.screen.query_one(ModelsTable)
            table.move_cursor(row=table.get_row_index("huge-context"))
            await pilot.pause()
            assert "does not fit now" in plain(app.screen.query_one("#model-detail"))

            # "/" filters; enter on an unusable one says why and opens nothing
            await pilot.press("slash", *"trunc", "enter")
            await wait_until(pilot, lambda: table.row_count == 1)
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert isinstance(app.screen, ModelsScreen)
            assert any("cannot run here" in n.message for n in app._notifications)

            # filter to the default model; enter shows the plan diff: every layer a fresh load
            await pilot.press("slash", *(["backspace"] * 5), *"smollm2:135", "enter")
            await wait_until(pilot, lambda: table.row_count == 1 and table.selected_name == "smollm2:135m")
            await pilot.press("enter")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange), timeout=60)
            preview = app.screen.preview
            assert preview.action == "model" and preview.targets == ("smollm2:135m",) and not preview.error, preview
            assert preview.moves and all(m.src is None for m in preview.moves)
            assert sum(m.end - m.start for m in preview.moves) == 30
            assert preview.bytes_moved == sum(m.nbytes for m in preview.moves) > 90e6
            assert app.focused.id == "cancel"
            await pilot.press("y")
            await wait_until(pilot, lambda: cluster.model is not None and cluster.model.name == "smollm2:135m"
                             and cluster.plan is not None and app.screen is app.main_screen, timeout=180)
            assert cluster.model.path.samefile(default_model_path)

            # a chat answers from the new model
            chat = app.main_screen.query_one(ChatPane)
            chat.params = type(chat.params)(max_tokens=24, temperature=0.0)
            await chat.send("What is the capital of France?")
            await wait_until(pilot, lambda: bool(chat.query(Answer)) and not chat.streaming, timeout=120)
            answer = chat.query_one(Answer)
            assert "Paris" in answer.text, answer.text
