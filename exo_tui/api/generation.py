"""One API request's generation, run as its own task so that the HTTP side can cancel it.

:class:`Generation` pumps ``coordinator.generate(request)`` into a queue. Cancelling it (a client
that disconnected) cancels the task between two pipeline steps; the generation loop's ``finally``
then releases the request's KV caches on every node. Either way it publishes one
:class:`~exo_tui.cluster.events.RequestDone` with the finish reason (``cancelled`` included).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from exo_tui.cluster import events as ev
from exo_tui.inference.generate import Chunk, GenerationError
from exo_tui.inference.request import Request


class Generation:
    def __init__(self, coordinator: Any, request: Request) -> None:
        self.coordinator = coordinator
        self.request = request
        self.finish_reason: str | None = None
        self.error = ""
        self.created = int(time.time())
        self._queue: asyncio.Queue[Chunk | BaseException | None] = asyncio.Queue()
        self._peeked: list[Chunk | BaseException | None] = []
        self._task = asyncio.create_task(self._pump(), name=f"api-{request.id}")

    async def _pump(self) -> None:
        finish, error = None, ""
        try:
            async for chunk in self.coordinator.generate(self.request):
                if chunk.finish_reason:
                    finish = chunk.finish_reason
                self._queue.put_nowait(chunk)
        except asyncio.CancelledError:
            finish = "cancelled"
            raise
        except GenerationError as exc:
            finish, error = "error", str(exc)
            self._queue.put_nowait(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 with the reason
            finish, error = "error", f"{type(exc).__name__}: {exc}"
            self._queue.put_nowait(exc)
        finally:
            self.finish_reason, self.error = finish or "cancelled", error
            self._queue.put_nowait(None)
            self._publish_done()

    def _publish_done(self) -> None:
        c, r = self.coordinator, self.request
        served = c.pipeline.served_by_request(r.id) if hasattr(c, "pipeline") else ()
        nodes = tuple(c.node_name(n) for n in served)
        c.events.publish(ev.RequestDone(
            request_id=r.id, finish_reason=self.finish_reason or "cancelled", prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.generated), ttft_s=r.ttft_s, tok_per_s=r.decode_tok_per_s, nodes=nodes,
            error=self.error,
        ))

    async def next(self) -> Chunk | None:
        """The next chunk; None once the generation is over. Raises what the generation raised."""
        if self._peeked:
            item = self._peeked.pop()
        else:
            item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def first(self) -> Chunk | None:
        """Wait for the first chunk without taking it (errors before any text surface here)."""
        if not self._peeked:
            self._peeked.append(await self._queue.get())
        item = self._peeked[0]
        if isinstance(item, BaseException):
            raise item
        return item

    async def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    @property
    def done(self) -> bool:
        return self._task.done()
