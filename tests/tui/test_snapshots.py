"""SVG snapshots of the console's views at 120×40 and 80×24, in both exo themes.

Rendered from the FakeCluster's fixed snapshot with a frozen clock and UTC event times, so they
are deterministic. Update with ``pytest tests/tui/test_snapshots.py --snapshot-update`` after a
deliberate change, and look at the report before committing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exo_tui.tui.screens.detail import NodeDetailScreen
from exo_tui.tui.screens.dialogs import ConfirmChange, HelpScreen
from exo_tui.tui.screens.hosts import HostsScreen
from exo_tui.tui.screens.models import ModelsScreen
from exo_tui.tui.widgets.chat import Answer, ChatPane
from exo_tui.tui.widgets.nodes import NodesTable
from tests.tui.conftest import no_blink, wait_until

SIZES = [(120, 40), (80, 24)]
THEMES = ["exo-dark", "exo-light"]


async def _ready(pilot) -> None:  # noqa: ANN001
    app = pilot.app
    await wait_until(pilot, lambda: app.main_screen is not None and app.main_screen.query_one(NodesTable).row_count == 3)
    no_blink(app)


async def dashboard(pilot) -> None:  # noqa: ANN001
    await _ready(pilot)


async def node_detail(pilot) -> None:  # noqa: ANN001
    await _ready(pilot)
    await pilot.press("down", "enter")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, NodeDetailScreen))
    await pilot.pause(0.1)


async def help_screen(pilot) -> None:  # noqa: ANN001
    await _ready(pilot)
    await pilot.press("question_mark")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))


async def drain_confirmation(pilot) -> None:  # noqa: ANN001
    await _ready(pilot)
    await pilot.press("down", "D")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ConfirmChange))


async def hosts_bootstrap(pilot) -> None:  # noqa: ANN001
    app = pilot.app
    await _ready(pilot)
    await pilot.press("colon", *"hosts", "enter")
    await wait_until(pilot, lambda: isinstance(app.screen, HostsScreen))
    app.control.known_keys.add("10.0.0.20")  # the key question has its own test; here: the steps
    await pilot.press("b")
    await wait_until(pilot, lambda: "install" in app.bootstrap_steps.get("10.0.0.20", {}))
    app.refresh_now()  # the host's row says "bootstrapping" now, not at the next refresh tick (a loaded machine)
    await pilot.pause(0.1)
    app.clear_notifications()
    no_blink(app)
    await pilot.pause()


async def chat_answer(pilot) -> None:  # noqa: ANN001
    app = pilot.app
    await _ready(pilot)
    chat = app.main_screen.query_one(ChatPane)
    await chat.send("What is the capital of France?")
    await wait_until(pilot, lambda: bool(chat.query(Answer)) and not chat.streaming)
    await pilot.pause(0.1)
    no_blink(app)
    await pilot.pause()


async def model_picker(pilot) -> None:  # noqa: ANN001
    app = pilot.app
    await _ready(pilot)
    await pilot.press("m")
    await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.choices is not None)
    await pilot.press("down", "down")  # onto the one that does not fit: its reason shows below
    no_blink(app)
    await pilot.pause()


async def model_confirmation(pilot) -> None:  # noqa: ANN001
    app = pilot.app
    await model_picker(pilot)
    await pilot.press("up", "enter")
    await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
    no_blink(app)
    await pilot.pause()
async def cluster_strip(pilot) -> None:  # noqa: ANN001
    await _ready(pilot)
    await pilot.press("M")
    await pilot.pause(0.1)


VIEWS = {
    "dashboard": dashboard,
    "node_detail": node_detail,
    "help": help_screen,
    "drain_confirmation": drain_confirmation,
    "hosts_bootstrap": hosts_bootstrap,
    "chat_answer": chat_answer,
    "model_picker": model_picker,
    "model_confirmation": model_confirmation,
    "cluster_strip": cluster_strip,
}


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("view", list(VIEWS))
def test_view(snap_compare, make_app, view: str, size: tuple[int, int], theme: str) -> None:
    app = make_app(theme=theme)
    assert snap_compare(app, run_before=VIEWS[view], terminal_size=size)


def test_every_stored_snapshot_is_of_a_view_here() -> None:
    """A snapshot left behind by a renamed or removed view fails here. syrupy finds such files
    itself only in a run on one process; ``make test`` runs on several (pytest-xdist)."""
    stored = {p.name for p in (Path(__file__).parent / "__snapshots__" / "test_snapshots").glob("*.svg")}
    made = {f"test_view[{view}-{w}x{h}-{theme}].svg" for view in VIEWS for w, h in SIZES for theme in THEMES}
    assert stored - made == set(), "snapshots of no view: delete them"
