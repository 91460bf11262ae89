"""One API request's generation, run as its own task so that the HTTP side can cancel it.

:class:`Generation` pumps ``coordinator.generate(request)`` into a queue. Cancelling it (a client
that disconnected) stops it at the next token boundary: the step in flight ends (at most one more
token of node time), then the generation loop's ``finally`` releases the request's KV caches on
every node. Stopping between steps, rather than cancelling the task mid-step, matters: a step
already queued at a node would otherwise run after the drop and leave a cache behind. A step that
does not end within ``CANCEL_GRACE_S`` (a node gone quiet) is cancelled outright. Either way it publishes one
:class:`~exo_tui.events.RequestDone` with the finish reason (``cancelled`` included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request as HTTPRequest

from exo_tui import events as ev
from exo_tui.api.errors import ClientGone
from exo_tui.cluster.admission import QueueFull
from exo_tui.cluster.view import ServingCluster
from exo_tui.inference.generate import Chunk, GenerationError
from exo_tui.inference.request import Request

CANCEL_GRACE_S = 30.0

_T = TypeVar("_T")

log = logging.getLogger("exo_tui.api")

MAX_STOPS = 4  # stop strings a request may give (OpenAI's limit)
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # what a request leaves out, after the model's own


def context_note(coordinator: ServingCluster) -> str:
    """What a context-length error adds where the cluster serves the model at less than its own
    context (``models.context_length``, ``--context``): that a longer one can be had."""
    if coordinator.model is None:
        return ""
    own, served = coordinator.model.config.context_length, coordinator.context_length
    if served >= own:
        return ""
    return (f" (the cluster serves this model at {served} of its {own}: start it with --context {own}, "
            "or set models.context_length, for more)")


class Generation:
    def __init__(self, coordinator: ServingCluster, request: Request) -> None:
        self.coordinator = coordinator
        self.request = request
        self.finish_reason: str | None = None
        self.error = ""
        self.created = int(time.time())
        self._queue: asyncio.Queue[Chunk | BaseException | None] = asyncio.Queue()
        self._peeked: list[Chunk | BaseException | None] = []
        self._stop = asyncio.Event()
        self._closer: asyncio.Task[None] | None = None
        self._task = asyncio.create_task(self._pump(), name=f"api-{request.id}")

    async def _pump(self) -> None:
        finish, error = None, ""
        try:
            async with contextlib.aclosing(self.coordinator.generate(self.request)) as chunks:
                async for chunk in chunks:
                    if self._stop.is_set():
                        finish = "cancelled"
                        break
                    if chunk.finish_reason:
                        finish = chunk.finish_reason
                    self._queue.put_nowait(chunk)
        except asyncio.CancelledError:
            finish = "cancelled"
            raise
        except QueueFull as exc:  # a 429: counted as rejected (metrics), not failed
            finish, error = "rejected", str(exc)
            self._queue.put_nowait(exc)
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

    async def cancel(self, grace_s: float = CANCEL_GRACE_S) -> None:
        """Stop at the next token boundary (cancel outright after ``grace_s``) and wait for the end."""
        self._stop.set()
        admission = getattr(self.coordinator, "admission", None)
        if admission is not None and not self._task.done() and not admission.running(self.request.id):
            self._task.cancel()  # still waiting for a plan or its turn: nothing runs on the nodes yet
        if not self._task.done():
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(self._task)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    def cancel_soon(self) -> None:
        """:meth:`cancel` from code that cannot wait (a response stream being torn down)."""
        if not self._task.done() and self._closer is None:
            self._closer = asyncio.get_running_loop().create_task(self.cancel())

    @property
    def done(self) -> bool:
        return self._task.done()


async def until_done_or_disconnect(http: HTTPRequest, gen: Generation, work: Awaitable[_T]) -> _T:
    """Run ``work``; if the client goes away first, cancel the generation (its caches are dropped)."""
    work_task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        log.info("client went away: cancelling %s", gen.request.id)
        await gen.cancel()
        raise ClientGone()
    finally:
        for t in (work_task, gone):
            if not t.done():
                t.cancel()
        for t in (work_task, gone):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def _disconnected(http: HTTPRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
