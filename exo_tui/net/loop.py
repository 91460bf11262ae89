"""The event loop that node agents and the headless commands run on.

uvloop where it is installed (it comes with ``uvicorn[standard]``, a dependency), else asyncio's
own loop. Both are asyncio: the code on top is the same, uvloop only does the loop's work (socket
readiness, TLS records, timers) in C, which is most of what a hop costs besides the compute:
on loopback with TLS, three node processes decode one stream at 0.90× one node's rate on uvloop
against 0.85× on asyncio's loop, 0.9 against 1.3 ms per extra hop (``benchmarks/pipeline.py``,
five rounds alternating the two in one run).

``EXO_TUI_EVENT_LOOP=asyncio`` forces asyncio's loop (to compare, or to rule uvloop out when
chasing a bug); ``uvloop`` insists on uvloop and fails when it is missing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "EXO_TUI_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


class LoopChoiceError(ValueError):
    """The environment asks for an event loop this process cannot have."""


def _choice() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise LoopChoiceError(f"{ENV}={value!r} is not an event loop: use one of {', '.join(CHOICES)}")
    return value


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the loop to run on (see the module's docstring)."""
    choice = _choice()
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise LoopChoiceError(
                f"{ENV}=uvloop but uvloop is not installed: pip install uvloop, or unset {ENV}"
            ) from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``"uvloop"`` or ``"asyncio"``: what ``loop`` (default: the running one) is."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` chooses."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
