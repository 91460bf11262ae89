"""A :class:`Connection`: one authenticated, multiplexed connection.

A :class:`Connection` is bidirectional and multiplexed: either side may :meth:`~Connection.call`
(request → response matched by id) or :meth:`~Connection.send` (one-way), and frames that are not
responses go to the side's handler ``async def handler(conn, frame) -> Frame | None``. It is made
by :func:`exo_tui.net.client.connect` or handed to a server's handler
(:func:`exo_tui.net.server.serve`); this module knows nothing of how the stream was opened. Its
write side is :mod:`exo_tui.net.outbox`; error frames and :class:`Dispatcher` are
:mod:`exo_tui.net.dispatcher`.

Ordering and concurrency (the choice made here):

* **Calls** (frames with an id) run concurrently, each in its own task; a long handler (a forward
  step) never blocks the read loop. At most ``max_concurrent_calls`` run at once per connection;
  beyond that the read loop waits, which stops reading from the socket (TCP backpressure).
* **One-way frames** are handled one at a time, in arrival order, per *lane*. The lane is the
  ``lane`` given to :meth:`Connection.send`, by default the frame's type: all ``forward`` frames of
  a connection run in order, while a ``heartbeat`` never waits behind them. Give several types the
  same lane when their relative order matters. A lane's queue holds ``lane_queue`` frames; when it
  is full the read loop waits (backpressure). Don't make a one-way handler await a call on the same
  connection while that connection's lanes can fill up.
* **Inline types** (``inline_types`` of :func:`~exo_tui.net.server.serve` and
  :func:`~exo_tui.net.client.connect`): a one-way frame of one of these types whose lane is idle
  is handled right in the read loop, without the hand-off to the lane's task (one event-loop turn
  less per frame: what a pipeline hop pays for every token). Nothing else is read from that
  connection until such a handler returns, so give only handlers that return quickly and never
  await a call on the same connection.
* **Responses** are delivered to the waiting caller right in the read loop.
* **Writes coalesce** (:mod:`exo_tui.net.outbox`): small frames sent in one turn of the event loop
  leave in one write at the end of that turn; a frame sent with ``hold_s`` may wait up to that long
  for the frames after it.

A handler's returned frame is sent back as the response of a call (its ``id`` and ``response``
flag are set for you); ``None`` answers an empty ``ok`` frame. An exception answers an ``error``
frame (a :class:`RemoteError` with its message and code; anything else with code
``handler_error``, logged with its traceback), and the connection stays open. The result of a
one-way handler is ignored and its exceptions are logged (report failures with a frame of your own),
but for :class:`~exo_tui.net.errors.BadBody` (a body that does not fit its message), answered with
one ``error`` frame as a call's would be.

A broken frame (see :mod:`exo_tui.net.frame`) closes only its connection, after an ``error`` frame
with code ``bad_frame``; the server keeps serving the others. Everything is logged on the
``exo_tui.net`` logger with the peer's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import ssl
import struct
import sys
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from exo_tui.net.budget import ReceiveBudget, receive_budget
from exo_tui.net.outbox import SMALL_FRAME, Outbox
from exo_tui.net.ratelog import RateLimitedLog

if sys.platform != "win32":  # input_pending() asks the kernel how many bytes wait in a socket (POSIX)
    import fcntl
    import termios
from exo_tui.net.dispatcher import Handler, error_frame, remote_error
from exo_tui.net.errors import BadBody, ConnectionClosed, RemoteError, UnknownFrameType
from exo_tui.net.frame import (
    DEFAULT_LIMITS,
    PREFIX_SIZE,
    Frame,
    FrameError,
    IncompleteFrame,
    Limits,
    build_frame,
    encode_frame,
    header_length,
    parse_header,
)

log = logging.getLogger("exo_tui.net")

CloseCallback = Callable[["Connection", BaseException | None], Any]

STREAM_LIMIT = 1 << 20  # StreamReader buffer: reading pauses above twice this
MAX_CONCURRENT_CALLS = 256
MAX_LANES = 64
LANE_QUEUE = 64
CLOSE_TIMEOUT_S = 5.0
CHUNK = STREAM_LIMIT  # a payload larger than this is read in pieces of this size into one buffer


def _bare(e: BaseException) -> BaseException:
    """``e`` without its traceback and context, to keep as a connection's close reason: a
    traceback holds the frames of the read that failed, and so the payload buffer it was filling
    (up to the payload limit), for as long as the reason is kept."""
    e.__traceback__ = e.__context__ = e.__cause__ = None
    return e


class Connection:
    """One authenticated connection. Made by :func:`connect` or handed to a server's handler.

    Attributes: ``peer`` ("host:port"), ``peer_name`` (the common name of the peer's certificate:
    the node name it was issued for; empty without TLS), ``closed`` (a future resolved with the
    reason the connection closed: ``None`` when closed here without a reason, else an exception),
    ``data`` (a dict the application may use to keep per-connection state).
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        handler: Handler | None,
        limits: Limits = DEFAULT_LIMITS,
        peer: str = "?",
        peer_name: str = "",
        max_concurrent_calls: int = MAX_CONCURRENT_CALLS,
        inline_types: Collection[str] = (),
        budget: ReceiveBudget | None = None,
        ratelog: RateLimitedLog | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self.peer_name = peer_name
        self.data: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._budget = budget if budget is not None else receive_budget()
        self._limited = ratelog if ratelog is not None else RateLimitedLog(log)  # what the peer can repeat at will
        self.closed: asyncio.Future[BaseException | None] = loop.create_future()
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._ids = itertools.count(1)
        self._lanes: dict[str, asyncio.Queue[Frame]] = {}
        self._busy_lanes: set[str] = set()  # lanes whose task is running a handler
        self._inline_types = frozenset(inline_types)
        self._tasks: set[asyncio.Task[None]] = set()
        self._call_slots = asyncio.Semaphore(max_concurrent_calls)
        self._close_callbacks: list[CloseCallback] = []
        self._callback_tasks: set[asyncio.Future[Any]] = set()
        self._closing = False
        self._peer_error: RemoteError | None = None
        self.refusals = 0  # one-way frames of ours the peer refused as malformed (BadBody)
        self.last_refusal: RemoteError | None = None  # and why, the last time
        self._read_task: asyncio.Task[None] | None = None
        self._frame_since: float | None = None
        self._frame_timed_out = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._outbox = Outbox(writer, loop, peer)  # small frames wait here for the end of the loop turn

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return f"<Connection {self.peer} {self.peer_name!r} {state}>"

    # -------------------------------------------------------------- public API

    @property
    def local_address(self) -> str:
        """This side's address on the connection (the interface the peer reaches us on)."""
        sockname = self._writer.get_extra_info("sockname")
        return str(sockname[0]) if sockname else ""

    @property
    def is_closed(self) -> bool:
        return self._closing

    def input_pending(self) -> bool:
        """Whether bytes of a next frame have arrived and not been read yet (in this process's
        buffer or the socket's): a handler may then expect another frame right after its own."""
        if getattr(self._reader, "_buffer", None):  # asyncio.StreamReader's buffer (CPython)
            return True
        sock = self._writer.get_extra_info("socket")
        if sock is None or sys.platform == "win32":
            return False
        try:
            waiting: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
            return waiting > 0
        except (OSError, ValueError):
            return False

    async def call(
        self,
        type: str,
        body: dict[str, Any] | None = None,
        *,
        tensor: np.ndarray | None = None,
        payload: bytes | bytearray | memoryview | None = None,
        plan: int | None = None,
        timeout: float | None = None,
    ) -> Frame:
        """Send a request and wait for its response frame.

        Raises :class:`RemoteError` when the peer answers with an ``error`` frame,
        :class:`ConnectionClosed` when the connection closes first, :class:`TimeoutError` after
        ``timeout`` seconds (the late response is then dropped).
        """
        if self._closing:
            raise self._closed_error()
        fid = next(self._ids)
        fut: asyncio.Future[Frame] = self._loop.create_future()
        self._pending[fid] = fut
        try:
            await self._write(Frame(type, body or {}, tensor, payload, plan, fid))
            if timeout is None:
                return await fut
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pending.pop(fid, None)

    async def send(
        self,
        type: str,
        body: dict[str, Any] | None = None,
        *,
        tensor: np.ndarray | None = None,
        payload: bytes | bytearray | memoryview | None = None,
        plan: int | None = None,
        lane: str | None = None,
        hold_s: float = 0.0,
    ) -> None:
        """Send a one-way frame (no response). Returns once it is written and the socket drained
        enough (backpressure). ``lane``: see the module doc (default: the type). ``hold_s``: a
        small frame may wait up to that long for the frames sent after it (see the module doc)."""
        if self._closing:
            raise self._closed_error()
        await self._write(Frame(type, body or {}, tensor, payload, plan, 0, lane=lane), hold_s)

    @property
    def held_s(self) -> float:
        """How long the oldest frame sent with ``hold_s`` has waited in the outbox (0: none waits)."""
        return self._outbox.held_s

    def on_close(self, callback: CloseCallback) -> None:
        """Call ``callback(conn, reason)`` once when the connection closes (at once if it has).
        A coroutine function is scheduled as a task."""
        if self.closed.done():
            self._loop.call_soon(self._run_callback, callback, self.closed.result())
        else:
            self._close_callbacks.append(callback)

    def close(self, reason: BaseException | None = None) -> None:
        """Close now (idempotent): pending calls fail with :class:`ConnectionClosed`, running
        handlers are cancelled, buffered frames are flushed."""
        self._shutdown(reason)

    async def wait_closed(self) -> None:
        """Wait until the connection and its tasks are completely gone."""
        await asyncio.shield(self.closed)
        tasks = [t for t in (self._read_task, *self._tasks) if t is not None and t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._writer.wait_closed()
        except (TimeoutError, OSError, ssl.SSLError, ConnectionError):
            self._writer.transport.abort()

    async def aclose(self, reason: BaseException | None = None) -> None:
        self.close(reason)
        await self.wait_closed()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -------------------------------------------------------------- internals

    def start(self) -> None:
        self._read_task = self._loop.create_task(self._read_loop(), name=f"exo-tui read {self.peer}")
        self._arm_watchdog()

    def _arm_watchdog(self) -> None:
        # One timer per connection instead of a timeout around every frame read (cheaper per frame).
        period = max(0.02, min(1.0, self.limits.frame_timeout_s / 4))
        self._watchdog = self._loop.call_later(period, self._check_frame_time)

    def _check_frame_time(self) -> None:
        if self._closing:
            return
        since = self._frame_since
        if since is not None and self._loop.time() - since > self.limits.frame_timeout_s and self._read_task:
            self._frame_timed_out = True
            self._read_task.cancel()
            return
        self._arm_watchdog()

    def _closed_error(self) -> ConnectionClosed:
        reason = self.closed.result() if self.closed.done() else None
        if isinstance(reason, ConnectionClosed):
            return reason
        return ConnectionClosed(f"connection to {self.peer} is closed" + (f": {reason}" if reason else ""))

    async def _write(self, frame: Frame, hold_s: float = 0.0) -> None:
        head, raw = encode_frame(frame)
        if self._closing:
            raise self._closed_error()
        if raw is None or len(raw) <= SMALL_FRAME:
            self._outbox.put(head if raw is None else head + raw, hold_s)  # one TLS record for a hidden state
        else:
            self._outbox.write_large(head, raw)
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._shutdown(ConnectionClosed(f"connection to {self.peer} lost: {e}"))
            raise self._closed_error() from None

    async def _read_exactly(self, n: int, what: str) -> bytes:
        try:
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise IncompleteFrame(f"connection closed inside a frame's {what} ({len(e.partial)} of {n} bytes)") from None

    async def _read_payload(self, n: int) -> bytes | bytearray:
        """``n`` payload bytes; a large payload is read in pieces into one buffer (the stream's
        buffer then never holds a second copy of it)."""
        if n <= CHUNK:
            return await self._read_exactly(n, "payload")
        buf = bytearray(n)
        view, pos, read = memoryview(buf), 0, self._reader.read
        while pos < n:
            chunk = await read(min(n - pos, CHUNK))
            if not chunk:
                raise IncompleteFrame(f"connection closed inside a frame's payload ({pos} of {n} bytes)")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        return buf

    async def _receive(self, header: Any) -> None:
        """Read a frame's payload and dispatch the frame, its bytes counted against the node-wide
        :class:`ReceiveBudget` from before the read until the dispatch returns (an inline frame:
        handled; another: queued or its call started)."""
        self._frame_since = None  # waiting for the budget is not the peer's stall
        charged = await self._budget.acquire(header.nbytes)
        try:
            self._frame_since = self._loop.time()
            frame = build_frame(header, await self._read_payload(header.nbytes))
            self._frame_since = None
            await self._dispatch(frame)
            del frame  # not kept while the next frame is read: its handler owns it now
        finally:
            self._budget.release(charged)

    async def _read_loop(self) -> None:
        reader, limits, loop = self._reader, self.limits, self._loop
        reason: BaseException | None = None
        try:
            try:
                while True:
                    try:
                        prefix = await reader.readexactly(PREFIX_SIZE)
                    except asyncio.IncompleteReadError as e:
                        if e.partial:
                            raise IncompleteFrame("connection closed inside a frame's length prefix") from None
                        why = f": {self._peer_error}" if self._peer_error else ""
                        reason = ConnectionClosed(f"connection closed by {self.peer}{why}")
                        break
                    n = header_length(prefix, limits)
                    self._frame_since = loop.time()  # the watchdog enforces limits.frame_timeout_s
                    header = parse_header(await self._read_exactly(n, "header"), limits)
                    if header.nbytes:
                        await self._receive(header)
                    else:
                        self._frame_since = None
                        await self._dispatch(build_frame(header, None))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._frame_timed_out or task is None:
                    raise
                task.uncancel()
                raise IncompleteFrame(f"frame not completed within {limits.frame_timeout_s} s") from None
        except FrameError as e:
            self._limited.warning("bad_frame", "closing connection with %s: bad frame: %s", self.peer, e)
            with contextlib.suppress(Exception):
                head, _ = encode_frame(error_frame(str(e), e.code))
                self._outbox.put(head)
            reason = _bare(e)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError, ssl.SSLError) as e:
            reason = ConnectionClosed(f"connection to {self.peer} lost: {type(e).__name__}: {e}")
            log.info("%s", reason)
        except Exception as e:  # a bug here must not leave a half-dead connection
            log.exception("read loop of %s failed", self.peer)
            reason = _bare(e)
        self._shutdown(reason)

    async def _dispatch(self, frame: Frame) -> None:
        if frame.response:
            fut = self._pending.pop(frame.id, None)
            if fut is None or fut.done():
                log.debug("dropping a late or unknown response %s #%d from %s", frame.type, frame.id, self.peer)
            elif frame.type == "error":
                fut.set_exception(remote_error(frame))
            else:
                fut.set_result(frame)
            return
        if frame.type == "error":
            err = remote_error(frame)
            if err.code == BadBody.code:  # a one-way frame of ours it refused; it goes on serving
                self.refusals += 1
                self.last_refusal = err
                self._limited.warning("bad_body", "%s refused a frame of ours: %s", self.peer, err)
                return
            self._peer_error = err  # the peer says why it is about to close
            log.warning("%s reports an error: %s", self.peer, self._peer_error)
            return
        if frame.id:
            await self._call_slots.acquire()
            self._track(self._loop.create_task(self._run_call(frame)))
            return
        lane = frame.lane or frame.type
        q = self._lanes.get(lane)
        if frame.type in self._inline_types and (q is None or (q.empty() and lane not in self._busy_lanes)):
            await self._handle_one_way(frame)  # in order: nothing of this lane is waiting or running
            return
        if q is None:
            if len(self._lanes) >= MAX_LANES:
                raise FrameError(f"more than {MAX_LANES} one-way lanes on one connection")
            q = self._lanes[lane] = asyncio.Queue(LANE_QUEUE)
            self._track(self._loop.create_task(self._lane_worker(lane, q)))
        await q.put(frame)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_call(self, frame: Frame) -> None:
        try:
            try:
                if self.handler is None:
                    raise UnknownFrameType(f"this side takes no requests (got {frame.type!r})")
                resp = await self.handler(self, frame)
                if resp is None:
                    resp = Frame("ok")
                elif not isinstance(resp, Frame):
                    raise TypeError(f"handler for {frame.type!r} returned {type(resp).__name__}, not a Frame")
                resp.id, resp.response, resp.lane = frame.id, True, None
                try:
                    await self._write(resp)
                    return
                except (TypeError, ValueError) as e:  # could not encode the response
                    raise TypeError(f"response to {frame.type!r} cannot be sent: {e}") from None
            except asyncio.CancelledError:
                raise
            except ConnectionClosed:
                return
            except RemoteError as e:
                resp = error_frame(e.message, e.code, e.detail)
            except Exception as e:
                log.exception("handler for %s from %s failed", frame.type, self.peer)
                resp = error_frame(f"{type(e).__name__}: {e}", "handler_error")
            resp.id, resp.response = frame.id, True
            with contextlib.suppress(ConnectionClosed):
                await self._write(resp)
        finally:
            self._call_slots.release()

    async def _lane_worker(self, lane: str, q: asyncio.Queue[Frame]) -> None:
        while True:
            frame = await q.get()
            self._busy_lanes.add(lane)
            try:
                await self._handle_one_way(frame)
            finally:
                self._busy_lanes.discard(lane)
                del frame  # not kept while waiting for the next one

    async def _handle_one_way(self, frame: Frame) -> None:
        try:
            if self.handler is None:
                self._limited.warning("one_way_dropped", "dropping one-way %s from %s: this side has no handler",
                                frame.type, self.peer)
                return
            await self.handler(self, frame)
        except asyncio.CancelledError:
            raise
        except ConnectionClosed:
            pass
        except RemoteError as e:
            self._limited.warning(f"one_way_refused {e.code}", "one-way %s from %s refused: %s", frame.type, self.peer, e)
            if isinstance(e, BadBody):  # the sender learns what it sent wrong; the connection stays
                with contextlib.suppress(ConnectionClosed):
                    await self._write(error_frame(e.message, e.code))
        except Exception:
            log.exception("handler for one-way %s from %s failed", frame.type, self.peer)

    def _shutdown(self, reason: BaseException | None) -> None:
        if self._closing:
            return
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if not self.closed.done():
            self.closed.set_result(reason)
        err = self._closed_error()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        current = asyncio.current_task()
        for t in (self._read_task, *self._tasks):
            if t is not None and t is not current:
                t.cancel()
        with contextlib.suppress(Exception):
            self._outbox.flush()  # frames sent before the close still go
            self._writer.close()
        callbacks, self._close_callbacks = self._close_callbacks, []
        for cb in callbacks:
            self._run_callback(cb, reason)

    def _run_callback(self, cb: CloseCallback, reason: BaseException | None) -> None:
        try:
            r = cb(self, reason)
            if inspect.isawaitable(r):  # keep a reference; wait_closed does not wait for these
                t = asyncio.ensure_future(r)
                self._callback_tasks.add(t)
                t.add_done_callback(self._callback_tasks.discard)
        except Exception:
            log.exception("close callback of %s failed", self.peer)

