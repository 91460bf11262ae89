"""Which event loop node agents and headless commands run on (exo_tui.net.loop)."""

from __future__ import annotations

import asyncio
import sys
import warnings

import pytest

from exo_tui.net import loop as event_loop
from exo_tui.net.loop import LoopChoiceError, loop_name


async def _which() -> str:
    await asyncio.sleep(0)
    return loop_name()


def test_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvloop comes with uvicorn[standard], a dependency: missing here is an install defect, not a skip.
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.run(_which()) == "uvloop"


@pytest.mark.parametrize(("value", "expected"), [("asyncio", "asyncio"), ("uvloop", "uvloop"), (" AUTO ", "uvloop")])
def test_the_environment_chooses(monkeypatch: pytest.MonkeyPatch, value: str, expected: str) -> None:
    monkeypatch.setenv(event_loop.ENV, value)
    assert event_loop.run(_which()) == expected


def test_asyncio_when_uvloop_is_missing_unless_insisted_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.run(_which()) == "asyncio"
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    with pytest.raises(LoopChoiceError, match="uvloop is not installed"):
        event_loop.loop_factory()


def test_an_unknown_loop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "trio")
    with pytest.raises(LoopChoiceError, match="not an event loop: use one of auto, uvloop, asyncio"):
        event_loop.loop_factory()
    main = _which()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine left unawaited would warn
        with pytest.raises(LoopChoiceError):
            event_loop.run(main)
    assert main.cr_frame is None  # closed, not left pending


def test_run_returns_the_result_and_closes_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    seen: list[asyncio.AbstractEventLoop] = []

    async def main() -> int:
        seen.append(asyncio.get_running_loop())
        return 7

    assert event_loop.run(main()) == 7
    assert seen[0].is_closed()
