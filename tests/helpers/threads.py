"""Running a test's work on a thread of its own (as a node agent's workers call shards)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_another_thread(work: Callable[[], T], timeout: float = 120.0) -> T:
    """``work()`` run on a new thread: its result, or the exception it raised, raised here."""
    results: dict[str, object] = {}

    def run() -> None:
        try:
            results["value"] = work()
        except BaseException as exc:  # handed back to the caller
            results["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"the work did not finish within {timeout:g} s")
    if "error" in results:
        raise results["error"]  # type: ignore[misc]
    return results["value"]  # type: ignore[return-value]
