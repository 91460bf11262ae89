"""The event loop that node agents and the headless commands run on.

uvloop where it is installed (it comes with ``uvicorn[standard]``, a dependency), else asyncio's
own loop. Both are asyncio: the code on top is the same, uvloop only does the loop's work (socket
readiness, TLS records, timers) in C. Measured side by side (``benchmarks/hop.py``, loopback,
both ends on the same loop): a decode hidden state's round trip with TLS takes 0.27 ms on uvloop
against 0.33 ms on asyncio's loop, and prefill-sized frames and weight chunks gain too. Beside a
decode step of ~15 ms that is small: end to end (``benchmarks/pipeline.py``) the two loops are
within this machine's run-to-run noise.

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
    try:
        factory = loop_factory()
    except LoopChoiceError:
        main.close()  # never started: no "coroutine was never awaited" warning beside the error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
