"""The listening side: :func:`serve` → :class:`Server`.

Every accepted connection waits for its TLS ClientHello (within :data:`PRE_TLS_S` while the
slots are under pressure), shows the slot cookie in it or not (proved or a stranger, see
:mod:`exo_tui.net.gate` and :mod:`exo_tui.net.slot`), and does TLS and the HMAC handshake: the
whole of it within ``security.handshake_timeout_s`` of its accept, a stranger's within
:data:`~exo_tui.net.gate.STRANGER_S` while strangers hold half their share of the slots. Only then
does it become a :class:`~exo_tui.net.connection.Connection` with the server's handler. Refusals are logged
(rate-limited: a flood logs once per kind) and closed; the server keeps serving the others.

Example (the client side is :func:`exo_tui.net.client.connect`)::

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
import inspect
import logging
import socket
import ssl
from collections.abc import Callable, Collection
from typing import Any

from exo_tui.net import auth
from exo_tui.net.connection import CLOSE_TIMEOUT_S, MAX_CONCURRENT_CALLS, STREAM_LIMIT, Connection
from exo_tui.net.dispatcher import Handler
from exo_tui.net.errors import AuthError, ConnectionClosed, HandshakeError
from exo_tui.net.frame import DEFAULT_LIMITS, Limits
from exo_tui.net.gate import STRANGER_S, HandshakeGate, Refused, Ticket
from exo_tui.net.ratelog import RateLimitedLog
from exo_tui.net.security import Security
from exo_tui.net.slot import SlotCookies, client_hello_server_name
from exo_tui.net.transport import (
    TLSFirst,
    error_text,
    format_address,
    local_name,
    peer_identity,
    start_tls,
    tune_socket,
)

log = logging.getLogger("exo_tui.net")

PRE_TLS_S = 1.0  # a new connection's TLS ClientHello must arrive within this time


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
        self._handshakes: set[asyncio.Task[None]] = set()
        self.gate = gate if gate is not None else HandshakeGate()
        self.cookies = SlotCookies(security.cluster_key)
        self.limited = RateLimitedLog(log)  # refusals and its connections' refused frames, per kind
        self.refused = 0  # connections refused before or during their handshake
        self._server: asyncio.base_events.Server | None = None
        self._closed = False

    async def _start(self, host: str | None, port: int, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        tls_first = self.security.enable_tls

        def protocol() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, but see TLSFirst
            reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
            cls = TLSFirst if tls_first else asyncio.StreamReaderProtocol
            return cls(reader, self._accept, loop=loop)

        if sock is not None:
            self._server = await loop.create_server(protocol, sock=sock)
        else:
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
        peer = format_address(peername)
        address = str(peername[0]) if isinstance(peername, tuple) and peername else peer
        accepted = asyncio.get_running_loop().time()
        try:
            protocol = getattr(writer, "_protocol", None)
            hello_in = (lambda p=protocol: p.client_hello_in) if isinstance(protocol, TLSFirst) else None
            ticket = self.gate.admit(address, task.cancel, hello_in)
        except Refused as e:
            self.refused += 1
            self.limited.warning("busy", "refused connection from %s: %s (someone may be flooding this port)", peer, e)
            writer.transport.abort()
            return
        self._handshakes.add(task)
        sec = self.security
        try:
            tune_socket(writer)
            try:
                fp_client, name = b"", ""
                if sec.enable_tls:
                    await self._wait_hello(writer, ticket)
                else:
                    self.gate.hello(ticket, proved=False)
                stranger = not ticket.proved and self.gate.under_pressure
                deadline_s = min(STRANGER_S, sec.handshake_timeout_s) if stranger else sec.handshake_timeout_s
                async with asyncio.timeout_at(accepted + deadline_s):
                    if sec.enable_tls:
                        try:
                            await start_tls(writer, sec.server_context())
                        except (ssl.SSLError, ConnectionError, OSError) as e:
                            raise AuthError(
                                f"TLS handshake failed ({error_text(e)}): the peer has no certificate of this "
                                "cluster, or TLS is off on its side"
                            ) from None
                        fp_client, name = peer_identity(writer)
                    await auth.server_handshake(
                        reader, writer, sec.cluster_key, fp_server=sec.fingerprint if sec.enable_tls else b"",
                        fp_client=fp_client, local=local_name(sec),
                    )
            except TimeoutError:
                raise AuthError(f"no complete handshake within {deadline_s} s of its connection") from None
            except (ssl.SSLError, ConnectionError, OSError) as e:
                if isinstance(e, HandshakeError):
                    raise
                raise AuthError(f"connection failed during the handshake: {type(e).__name__}: {error_text(e)}") from None
        except Refused as e:
            self.refused += 1
            self.limited.warning("busy", "refused connection from %s: %s (someone may be flooding this port)", peer, e)
            writer.transport.abort()
            return
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

    async def _wait_hello(self, writer: asyncio.StreamWriter, ticket: Ticket) -> None:
        """The TLS ClientHello within :data:`PRE_TLS_S` (or :class:`AuthError`), then the gate's
        word on it (:class:`~exo_tui.net.gate.Refused` for a stranger over its caps)."""
        protocol = getattr(writer, "_protocol", None)
        if not isinstance(protocol, TLSFirst):
            self.gate.hello(ticket, proved=False)
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
        self.gate.hello(ticket, proved=self.cookies.proved(client_hello_server_name(protocol.first_record)))

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
    sock: socket.socket | None = None,
) -> Server:
    """Listen on ``host:port`` (port 0: any free port, see ``Server.port``; host ``None`` or
    ``"0.0.0.0"``: every interface), or on ``sock``, bound already (:func:`listening_socket`).

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
    await server._start(host, port, sock)
    log.info("listening on %s:%d (TLS %s)", server.host, server.port, "on" if security.enable_tls else "OFF")
    return server


def listening_socket(host: str | None, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free one, read it with ``getsockname``)
    for :func:`serve`: a node that must say its port before it serves (``--port 0 --join``)."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock

