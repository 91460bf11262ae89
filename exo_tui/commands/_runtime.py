"""Running a command's asyncio main so that SIGTERM and SIGINT clean up like an exception would:
the main task is cancelled, its ``finally`` blocks stop what it started (node processes,
servers), and the process exits with 128 + the signal number. The loop is uvloop where installed
(see :mod:`exo_tui.net.loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from exo_tui.net import loop as event_loop


def run_main(main: Callable[[], Awaitable[Any]]) -> Any:
    received: list[int] = []

    async def runner() -> Any:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None

        def on_signal(signum: int) -> None:
            received.append(signum)
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal, sig)
        return await main()

    try:
        return event_loop.run(runner())
    except asyncio.CancelledError:
        if received:
            return 128 + received[0]
        raise
