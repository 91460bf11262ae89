"""Fixtures of the console tests: a fixed time zone, a FakeCluster, an app factory, wait helpers."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import pytest
from textual.widgets import Input

from exo_tui.tui.app import ExoApp
from tests.tui.fake_cluster import T0, FakeCluster


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """Event times render in UTC so snapshots do not depend on the machine's zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ", raising=False)
    time.tzset()


@pytest.fixture
def fake() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def make_app(fake: FakeCluster) -> Callable[..., ExoApp]:
    def make(control=None, **kwargs) -> ExoApp:  # noqa: ANN001
        kwargs.setdefault("clock", lambda: T0 + 2)
        return ExoApp(control or fake, **kwargs)

    return make


def no_blink(app: ExoApp) -> None:
    for box in app.query(Input):
        box.cursor_blink = False
    for screen in app.screen_stack:
        for box in screen.query(Input):
            box.cursor_blink = False


async def wait_until(pilot, predicate: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ANN001
    """Let the app run until ``predicate()`` holds (or fail after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            notes = [n.message for n in pilot.app._notifications]
            notes.append(str(getattr(pilot.app.screen, "preview", "")))
            raise AssertionError(f"timed out waiting for {predicate}; screen {pilot.app.screen}; notifications {notes}")
        await pilot.pause(0.02)
    await pilot.pause()


if os.environ.get("TEXTUAL_ANIMATIONS") is None:
    os.environ["TEXTUAL_ANIMATIONS"] = "none"


def plain(widget) -> str:  # noqa: ANN001
    """The text a Static shows (its content rendered without styles)."""
    from rich.console import Console
    from rich.text import Text

    content = widget.content
    if isinstance(content, Text):
        return content.plain
    if isinstance(content, str):
        return content
    console = Console(width=200, record=True, color_system=None, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(content)
    return console.export_text()
