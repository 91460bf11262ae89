"""Asyncio RPC over authenticated frames: :func:`serve`, :func:`connect`, :class:`Connection`.

A :class:`Connection` is bidirectional and multiplexed: either side may :meth:`~Connection.call`
(request → response matched by id) or :meth:`~Connection.send` (one-way), and frames that are not
responses go to the side's handler ``async def handler(conn, frame) -> Frame | None``.

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
* **Inline types** (``inline_types`` of :func:`serve` and :func:`connect`): a one-way frame of
  one of these types whose lane is idle is handled right in the read loop, without the hand-off
  to the lane's task (one event-loop turn less per frame: what a pipeline hop pays for every
  token). Nothing else is read from that connection until such a handler returns, so give only
  handlers that return quickly and never await a call on the same connection.
* **Responses** are delivered to the waiting caller right in the read loop.
* **Writes coalesce**: small frames sent in one turn of the event loop leave in one write at the
  end of that turn (one TLS record, one system call, one wake-up of the peer). A node that ran
  eight requests' steps together sends their eight results as one write, and the coordinator its
  eight next steps; a lone frame waits only for the rest of the turn it was sent in.

A handler's returned frame is sent back as the response of a call (its ``id`` and ``response``
flag are set for you); ``None`` answers an empty ``ok`` frame. An exception answers an ``error``
frame (a :class:`RemoteError` with its message and code; anything else with code
``handler_error``, logged with its traceback), and the connection stays open. The result of a
one-way handler is ignored and its exceptions are logged (report failures with a frame of your own).

A broken frame (see :mod:`exo_tui.net.frame`) closes only its connection, after an ``error`` frame
with code ``bad_frame``; the server keeps serving the others. Everything is logged on the
``exo_tui.net`` logger with the peer's address.

Example::

    security = Security.coordinator()          # or Security.from_bundle_file(path) on a node
    dispatch = Dispatcher()

    @dispatch.route("echo")
    async def echo(conn, frame):
        return Frame("echo", body=frame.body, tensor=frame.tensor)

    server = await serve(dispatch, "127.0.0.1", 0, security=security)
    conn = await connect("127.0.0.1", server.port, security=security)
    reply = await conn.call("echo", {"n": 1}, tensor=np.zeros(576, np.float32))
    await conn.aclose()
    server.close()
    await server.wait_closed()
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import logging
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import numpy as np

from exo_tui.net import auth
from exo_tui.net.budget import ReceiveBudget, receive_budget
from exo_tui.net.gate import HandshakeGate, Refused
from exo_tui.net.ratelog import RateLimitedLog

try:  # input_pending() asks the kernel how many bytes wait in a socket (POSIX)
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not POSIX
    fcntl = termios = None  # type: ignore[assignment]
from exo_tui.net.errors import (
    AuthError,
    ConnectError,
    ConnectionClosed,
    HandshakeError,
    RemoteError,
    UnknownFrameType,
)
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
from exo_tui.net.security import Security

log = logging.getLogger("exo_tui.net")

Handler = Callable[["Connection", Frame], Awaitable[Frame | None]]
CloseCallback = Callable[["Connection", BaseException | None], Any]

STREAM_LIMIT = 1 << 20  # StreamReader buffer: reading pauses above twice this
MAX_CONCURRENT_CALLS = 256
MAX_LANES = 64
LANE_QUEUE = 64
CLOSE_TIMEOUT_S = 5.0
SMALL_FRAME = 64 << 10  # a frame this small is copied into one write with its header ...
OUTBOX_BYTES = 64 << 10  # ... and frames sent in one loop turn are held up to this many bytes
PRE_TLS_S = 1.0  # a new connection's TLS ClientHello must arrive within this time
CHUNK = STREAM_LIMIT  # a payload larger than this is read in pieces of this size into one buffer


def _fmt_addr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in str(host) else f"{host}:{addr[1]}"
    return str(addr or "?")


def error_frame(message: str, code: str = "error") -> Frame:
    return Frame("error", {"message": message, "code": code})


def _remote_error(frame: Frame) -> RemoteError:
    body = frame.body if isinstance(frame.body, dict) else {}
    message = body.get("message")
    code = body.get("code")
    cls = UnknownFrameType if code == UnknownFrameType.code else RemoteError
    return cls(
        str(message) if message is not None else "error without a message",
        code=str(code) if code is not None else None,
    )


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def _tune_socket(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY (small frames go out at once) and TCP keepalive, so a peer that vanished
    without closing (power cut, cable) breaks the connection in ~25 s even when nothing is sent."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # Linux / macOS
        if idle is not None:
            sock.setsockopt(socket.IPPROTO_TCP, idle, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


async def _start_tls(writer: asyncio.StreamWriter, ctx: ssl.SSLContext) -> None:
    """``writer.start_tls``, marking the stream protocol as TLS first: on CPython 3.11 an EOF that
    arrives right after the TLS handshake, before ``start_tls`` returns, otherwise makes asyncio
    warn "returning true from eof_received() has no effect when using ssl". A server's stream
    (:class:`_TLSFirst`) upgrades itself, with the bytes it held back."""
    protocol = getattr(writer, "_protocol", None)
    if protocol is not None and hasattr(protocol, "_over_ssl"):
        protocol._over_ssl = True
    if isinstance(protocol, _TLSFirst):
        await protocol.upgrade(writer, ctx)
    else:
        await writer.start_tls(ctx)


def _why(e: BaseException) -> str:
    """An exception's text, never empty (``ssl`` and ``ConnectionResetError`` often have none)."""
    if isinstance(e, ssl.SSLError) and getattr(e, "reason", None):
        return str(e.reason).lower().replace("_", " ")
    return str(e) or type(e).__name__


def _bare(e: BaseException) -> BaseException:
    """``e`` without its traceback and context, to keep as a connection's close reason: a
    traceback holds the frames of the read that failed, and so the payload buffer it was filling
    (up to the payload limit), for as long as the reason is kept."""
    e.__traceback__ = e.__context__ = e.__cause__ = None
    return e


def _local_name(sec: Security) -> str:
    if sec.name == "coordinator":
        return "this coordinator"
    return f"this node ({sec.name})" if sec.name else "this process"


def _peer_identity(writer: asyncio.StreamWriter) -> tuple[bytes, str]:
    """(SHA-256 of the peer's certificate, its common name) on a TLS connection."""
    sslobj = writer.get_extra_info("ssl_object")
    if sslobj is None:
        return b"", ""
    der = sslobj.getpeercert(binary_form=True)
    if not der:
        raise AuthError("the peer presented no certificate")
    name = ""
    for rdn in (sslobj.getpeercert() or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                name = v
    return hashlib.sha256(der).digest(), name


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
        self._tasks: set[asyncio.Task] = set()
        self._call_slots = asyncio.Semaphore(max_concurrent_calls)
        self._close_callbacks: list[CloseCallback] = []
        self._callback_tasks: set[asyncio.Future] = set()
        self._closing = False
        self._peer_error: RemoteError | None = None
        self._read_task: asyncio.Task | None = None
        self._frame_since: float | None = None
        self._frame_timed_out = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._outbox: list[bytes] = []  # encoded frames to write at the end of this loop turn
        self._outbox_bytes = 0

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
        if sock is None or fcntl is None:
            return False
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] > 0
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
    ) -> None:
        """Send a one-way frame (no response). Returns once it is written and the socket drained
        enough (backpressure). ``lane``: see the module doc (default: the type)."""
        if self._closing:
            raise self._closed_error()
        await self._write(Frame(type, body or {}, tensor, payload, plan, 0, lane=lane))

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

    async def _write(self, frame: Frame) -> None:
        head, raw = encode_frame(frame)
        if self._closing:
            raise self._closed_error()
        w = self._writer
        if raw is None or len(raw) <= SMALL_FRAME:
            self._hold(head if raw is None else head + raw)  # one TLS record for a hidden state
        else:
            self._flush()  # what was sent before goes first
            w.writelines((head, raw))  # no copy of a large payload here
        try:
            await w.drain()
        except (ConnectionError, OSError) as e:
            self._shutdown(ConnectionClosed(f"connection to {self.peer} lost: {e}"))
            raise self._closed_error() from None

    def _hold(self, data: bytes) -> None:
        """Queue ``data`` for the write at the end of this loop turn (at once past OUTBOX_BYTES,
        so a sender that never yields cannot grow the queue without bound)."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        if self._outbox_bytes >= OUTBOX_BYTES:
            self._flush()

    def _flush(self) -> None:
        box = self._outbox
        if not box:
            return
        self._outbox, self._outbox_bytes = [], 0
        try:
            self._writer.write(box[0] if len(box) == 1 else b"".join(box))
        except (ConnectionError, OSError, RuntimeError) as e:  # the read loop sees the loss too
            log.debug("write to %s failed: %s", self.peer, e)

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
                self._hold(head)
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
                fut.set_exception(_remote_error(frame))
            else:
                fut.set_result(frame)
            return
        if frame.type == "error":  # the peer says why it is about to close
            self._peer_error = _remote_error(frame)
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

    def _track(self, task: asyncio.Task) -> None:
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
                resp = error_frame(e.message, e.code)
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
            frame: Frame | None = await q.get()
            self._busy_lanes.add(lane)
            try:
                await self._handle_one_way(frame)  # type: ignore[arg-type]
            finally:
                self._busy_lanes.discard(lane)
                frame = None  # not kept while waiting for the next one

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
            self._flush()  # frames sent before the close still go
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


class Dispatcher:
    """A handler that routes frames by type; an unknown type is refused (``unknown_type``).

    ::

        d = Dispatcher()

        @d.route("ping")
        async def ping(conn, frame): return Frame("pong")

        d.add("forward", node.forward)
    """

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}

    def add(self, type: str, handler: Handler) -> None:
        self.routes[type] = handler

    def route(self, type: str) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.add(type, fn)
            return fn

        return deco

    async def __call__(self, conn: Connection, frame: Frame) -> Frame | None:
        fn = self.routes.get(frame.type)
        if fn is None:
            raise UnknownFrameType(f"unknown frame type {frame.type!r}")
        return await fn(conn, frame)


# ------------------------------------------------------------------ server


class _TLSFirst(asyncio.StreamReaderProtocol):
    """A server-side stream whose first bytes belong to TLS: it holds them back from the reader
    and hands them to the TLS protocol when it upgrades (:meth:`upgrade`).

    ``start_tls`` puts a TLS protocol on the socket, but bytes the plain stream has already read
    would stay in the reader's buffer, lost to TLS: a ClientHello that arrives before the accept
    task runs left the handshake waiting until its timeout (uvloop reads as soon as a connection
    is accepted, so under load this happened to about half the connections; asyncio's loop does
    the same when it is busy; MagicStack/uvloop#707, CPython gh-142352). What is held is bounded
    (``MAX_HELD``): a TLS client sends one ClientHello and waits."""

    MAX_HELD = 1 << 16  # a ClientHello is a few hundred bytes; a peer sending more first is not TLS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: bytearray | None = bytearray()
        self._plain: asyncio.BaseTransport | None = None
        self.hello = asyncio.Event()  # set when a whole first TLS record arrived, or it never will
        self.not_tls = ""  # why the first bytes cannot be a TLS ClientHello

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._plain = transport
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._held is None:
            super().data_received(data)
            return
        held = self._held
        held += data
        if self.hello.is_set():
            if len(held) > self.MAX_HELD:  # TLS has not taken over yet and the peer keeps sending
                self._refuse(f"{len(held)} bytes before the TLS handshake")
            return
        if held[0] != 0x16:  # a TLS handshake record starts with 22
            self._refuse("TLS handshake failed: its first bytes are not TLS (plain TCP, or TLS is off on its side: "
                         "network.security.enable_tls)")
        elif len(held) >= 5 and len(held) >= 5 + int.from_bytes(held[3:5], "big"):
            self.hello.set()
        elif len(held) > self.MAX_HELD:
            self._refuse(f"{len(held)} bytes before the TLS handshake (not a TLS client)")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.hello.is_set():
            self.not_tls = self.not_tls or "it closed the connection before its TLS ClientHello"
            self.hello.set()
        super().connection_lost(exc)

    def _refuse(self, why: str) -> None:
        self.not_tls = why
        self.hello.set()
        self._held = bytearray()  # nothing of it is wanted
        if self._plain is not None:
            self._plain.pause_reading()  # type: ignore[attr-defined]  # the accept task closes it

    async def upgrade(self, writer: asyncio.StreamWriter, ctx: ssl.SSLContext) -> None:
        """``writer.start_tls``, giving the held bytes to the TLS protocol as soon as ``start_tls``
        has put it on the socket (its first step does, before the handshake starts or reading
        resumes), so they come first, as they came."""
        transport = writer.transport
        if self.not_tls or transport.is_closing():
            raise ConnectionResetError(self.not_tls or "the connection closed before the TLS handshake")
        upgrade = asyncio.ensure_future(writer.start_tls(ctx))
        try:
            while transport.get_protocol() is self and not upgrade.done():
                await asyncio.sleep(0)
            if not (upgrade.done() and (upgrade.cancelled() or upgrade.exception() is not None)):
                self._hand_over(transport.get_protocol())
        except BaseException:
            upgrade.cancel()
            raise
        await upgrade

    def _hand_over(self, tls: asyncio.BaseProtocol) -> None:
        """Give the held bytes to ``tls`` (a buffered protocol, as asyncio's and uvloop's TLS
        protocols are); from now on bytes reaching this protocol are the decrypted stream."""
        held, self._held = self._held, None
        if not held or tls is self or not hasattr(tls, "get_buffer"):
            return
        view = memoryview(held)
        while view:
            buf = tls.get_buffer(len(view))  # type: ignore[attr-defined]
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            tls.buffer_updated(n)  # type: ignore[attr-defined]
            view = view[n:]


class Server:
    """A listening server (see :func:`serve`). ``port`` is the bound port (useful with port 0);
    ``connections`` the authenticated connections now open."""

    def __init__(
        self,
        handler: Handler | None,
        *,
        security: Security,
        limits: Limits,
        on_connect: Callable[[Connection], Any] | None,
        max_concurrent_calls: int,
        inline_types: Collection[str] = (),
        gate: HandshakeGate | None = None,
    ) -> None:
        self.handler = handler
        self.security = security
        self.limits = limits
        self.on_connect = on_connect
        self.max_concurrent_calls = max_concurrent_calls
        self.inline_types = frozenset(inline_types)
        self.host = ""
        self.port = 0
        self.connections: set[Connection] = set()
        self._handshakes: set[asyncio.Task] = set()
        self.gate = gate if gate is not None else HandshakeGate()
        self.limited = RateLimitedLog(log)  # refusals and its connections' refused frames, per kind
        self.refused = 0  # connections refused before or during their handshake
        self._server: asyncio.base_events.Server | None = None
        self._closed = False

    async def _start(self, host: str | None, port: int) -> None:
        loop = asyncio.get_running_loop()
        tls_first = self.security.enable_tls

        def protocol() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, but see _TLSFirst
            reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
            cls = _TLSFirst if tls_first else asyncio.StreamReaderProtocol
            return cls(reader, self._accept, loop=loop)

        self._server = await loop.create_server(protocol, host, port)
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closed:
            writer.transport.abort()
            return
        assert task is not None
        peername = writer.get_extra_info("peername")
        peer = _fmt_addr(peername)
        address = str(peername[0]) if isinstance(peername, tuple) and peername else peer
        try:
            ticket = self.gate.admit(address, task.cancel)
        except Refused as e:
            self.refused += 1
            self.limited.warning("busy", "refused connection from %s: %s (someone may be flooding this port)", peer, e)
            writer.transport.abort()
            return
        self._handshakes.add(task)
        sec = self.security
        try:
            _tune_socket(writer)
            try:
                fp_client, name = b"", ""
                if sec.enable_tls:
                    await self._wait_hello(writer, ticket)
                else:
                    ticket.hello = True
                async with asyncio.timeout(sec.handshake_timeout_s):
                    if sec.enable_tls:
                        try:
                            await _start_tls(writer, sec.server_context())
                        except (ssl.SSLError, ConnectionError, OSError) as e:
                            raise AuthError(
                                f"TLS handshake failed ({_why(e)}): the peer has no certificate of this "
                                "cluster, or TLS is off on its side"
                            ) from None
                        fp_client, name = _peer_identity(writer)
                    await auth.server_handshake(
                        reader, writer, sec.cluster_key, fp_server=sec.fingerprint if sec.enable_tls else b"",
                        fp_client=fp_client, local=_local_name(sec),
                    )
            except TimeoutError:
                raise AuthError(f"no complete handshake within {sec.handshake_timeout_s} s") from None
            except (ssl.SSLError, ConnectionError, OSError) as e:
                if isinstance(e, HandshakeError):
                    raise
                raise AuthError(f"connection failed during the handshake: {type(e).__name__}: {_why(e)}") from None
        except HandshakeError as e:
            self.refused += 1
            self.limited.warning("refused", "refused connection from %s: %s", peer, e)
            writer.transport.abort()
            return
        except asyncio.CancelledError:
            writer.transport.abort()
            if self._closed or self.gate.holds(ticket):  # a server closing, not an idle one dropped
                raise
            task.uncancel()
            self.limited.log(logging.INFO, "idle", "dropped an idle connection from %s (no TLS ClientHello) to make room",
                        peer)
            return
        except Exception:
            log.exception("handshake with %s failed", peer)
            writer.transport.abort()
            return
        finally:
            self._handshakes.discard(task)
            self.gate.release(ticket)
        self.gate.authenticated(address)
        conn = Connection(
            reader, writer, handler=self.handler, limits=self.limits, peer=peer, peer_name=name,
            max_concurrent_calls=self.max_concurrent_calls, inline_types=self.inline_types, ratelog=self.limited,
        )
        if self._closed:
            conn.close()
            return
        self.connections.add(conn)
        conn.on_close(lambda c, _r: self.connections.discard(c))
        log.info("accepted connection from %s (%s)", peer, name or "no certificate")
        conn.start()
        if self.on_connect is not None:
            try:
                r = self.on_connect(conn)
                if inspect.isawaitable(r):
                    await r
            except Exception:
                log.exception("on_connect for %s failed", peer)

    async def _wait_hello(self, writer: asyncio.StreamWriter, ticket: Any) -> None:
        """The TLS ClientHello within :data:`PRE_TLS_S`, or :class:`AuthError`; then the
        connection is no longer idle (see :mod:`exo_tui.net.gate`)."""
        protocol = getattr(writer, "_protocol", None)
        if not isinstance(protocol, _TLSFirst):
            ticket.hello = True
            return
        deadline_s = min(PRE_TLS_S, self.security.handshake_timeout_s)
        try:
            async with asyncio.timeout(deadline_s):
                await protocol.hello.wait()
        except TimeoutError:
            # A client whose loop is busy (a console drawing, a coordinator loading a model) may
            # be late: while the slots are not under pressure it gets the whole handshake time.
            if len(self.gate) * 2 >= self.gate.total:
                raise AuthError(f"no TLS ClientHello within {deadline_s} s") from None
            try:
                async with asyncio.timeout(self.security.handshake_timeout_s - deadline_s):
                    await protocol.hello.wait()
            except TimeoutError:
                raise AuthError(f"no TLS ClientHello within {self.security.handshake_timeout_s} s") from None
        if protocol.not_tls:
            raise AuthError(protocol.not_tls)
        ticket.hello = True

    def close(self) -> None:
        """Stop listening and close every connection (idempotent)."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for t in list(self._handshakes):
            t.cancel()
        for c in list(self.connections):
            c.close(ConnectionClosed("server closed"))

    async def wait_closed(self) -> None:
        conns = list(self.connections)
        pending = [c.wait_closed() for c in conns]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._handshakes:
            await asyncio.wait(list(self._handshakes), timeout=CLOSE_TIMEOUT_S)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def serve(
    handler: Handler | None,
    host: str | None,
    port: int,
    *,
    security: Security,
    limits: Limits = DEFAULT_LIMITS,
    on_connect: Callable[[Connection], Any] | None = None,
    max_concurrent_calls: int = MAX_CONCURRENT_CALLS,
    inline_types: Collection[str] = (),
    gate: HandshakeGate | None = None,
) -> Server:
    """Listen on ``host:port`` (port 0: any free port, see ``Server.port``; host ``None`` or
    ``"0.0.0.0"``: every interface).

    Every accepted connection does TLS (unless ``security.enable_tls`` is false) and the HMAC
    handshake within ``security.handshake_timeout_s``; refusals are logged and closed. Then its
    frames go to ``handler`` and ``on_connect(conn)`` is called (it may be a coroutine function).
    ``inline_types``: see the module doc. ``gate``: who may hold handshake slots (default
    :class:`~exo_tui.net.gate.HandshakeGate`'s limits).
    """
    server = Server(
        handler, security=security, limits=limits, on_connect=on_connect,
        max_concurrent_calls=max_concurrent_calls, inline_types=inline_types, gate=gate,
    )
    await server._start(host, port)
    log.info("listening on %s:%d (TLS %s)", server.host, server.port, "on" if security.enable_tls else "OFF")
    return server


# ------------------------------------------------------------------ client


def _tls_refusal(peer: str, e: BaseException) -> HandshakeError:
    """What a failed client-side TLS handshake means, from how it failed."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return HandshakeError(
            f"TLS handshake with {peer} failed ({e.verify_message or _why(e)}): its certificate is not from "
            "this cluster's CA (another cluster's node, or not a node of ours)"
        )
    if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
        if "alert" in _why(e):
            return AuthError(f"{peer} refused this side's certificate during TLS ({_why(e)}): it is not from "
                             "that node's cluster CA")
        return HandshakeError(
            f"TLS handshake with {peer} failed ({_why(e)}): TLS is off on one side "
            "(network.security.enable_tls), or it is not an exo-tui node agent"
        )
    # The peer closed or reset the connection before answering the ClientHello: what a node does
    # to connections it has no handshake slot for (or a server that is not TLS at all).
    return HandshakeError(
        f"{peer} closed the connection before the TLS handshake ({_why(e)}): the node is busy refusing "
        "handshakes (too many connections at once: someone may be flooding its port; see its log), "
        "or it is not an exo-tui node agent"
    )


async def open_authenticated(
    host: str, port: int, *, security: Security, timeout: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """TCP, TLS and the HMAC handshake, without the frame layer: ``(reader, writer, peer_name)``.

    For tools and tests that speak raw bytes; applications use :func:`connect`. Raises like it.
    """
    peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
            except OSError as e:
                raise ConnectError(
                    f"cannot connect to {peer}: {e.strerror or e}: is the node agent running there "
                    "(exo-tui node) and the port reachable?"
                ) from None
            _tune_socket(writer)
            fp_server, name = b"", ""
            if security.enable_tls:
                try:
                    await _start_tls(writer, security.client_context())
                except (ssl.SSLError, ConnectionError, OSError) as e:
                    raise _tls_refusal(peer, e) from None
                fp_server, name = _peer_identity(writer)
            try:
                await auth.client_handshake(
                    reader, writer, security.cluster_key, fp_server=fp_server,
                    fp_client=security.fingerprint if security.enable_tls else b"",
                    peer=f"node {peer}" if security.name == "coordinator" else peer, local=_local_name(security),
                )
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as e:
                raise AuthError(
                    f"{peer} refused the connection during the handshake ({e}): "
                    "this side's certificate is not from its cluster's CA"
                ) from None
    except TimeoutError:
        if writer is not None:
            writer.transport.abort()
        raise ConnectError(f"no complete connection to {peer} within {timeout} s (host down or firewalled?)") from None
    except BaseException:
        if writer is not None:
            writer.transport.abort()
        raise
    return reader, writer, name


async def connect(
    host: str,
    port: int,
    *,
    security: Security,
    timeout: float = 5.0,
    handler: Handler | None = None,
    limits: Limits = DEFAULT_LIMITS,
    max_concurrent_calls: int = MAX_CONCURRENT_CALLS,
    inline_types: Collection[str] = (),
) -> Connection:
    """Open an authenticated connection to a server (TCP, TLS, HMAC handshake within ``timeout``).

    ``handler`` serves frames the server sends on its own initiative (calls and one-way frames).
    ``inline_types``: see the module doc.
    Raises :class:`ConnectError` (not reachable), :class:`AuthError` (wrong cluster, refused),
    :class:`ProtocolMismatch` (other protocol version) or :class:`HandshakeError`.
    """
    reader, writer, name = await open_authenticated(host, port, security=security, timeout=timeout)
    conn = Connection(
        reader, writer, handler=handler, limits=limits,
        peer=f"[{host}]:{port}" if ":" in host else f"{host}:{port}", peer_name=name,
        max_concurrent_calls=max_concurrent_calls, inline_types=inline_types,
    )
    conn.start()
    return conn
