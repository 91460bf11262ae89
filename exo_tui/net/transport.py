"""Opening a connection's byte stream, for the server and the client alike: the TCP socket's
options, TLS (with the server's :class:`TLSFirst` stream protocol), the peer's certificate
identity, and the words for what failed. The HMAC handshake over it is :mod:`exo_tui.net.auth`;
the frames after it, :class:`~exo_tui.net.connection.Connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
from typing import Any, cast

from exo_tui.net.address import host_port
from exo_tui.net.errors import AuthError
from exo_tui.net.security import Security

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def tune_socket(writer: asyncio.StreamWriter) -> None:
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


async def start_tls(writer: asyncio.StreamWriter, ctx: ssl.SSLContext, server_hostname: str | None = None) -> None:
    """``writer.start_tls``, marking the stream protocol as TLS first: on CPython 3.11 an EOF that
    arrives right after the TLS handshake, before ``start_tls`` returns, otherwise makes asyncio
    warn "returning true from eof_received() has no effect when using ssl". A server's stream
    (:class:`TLSFirst`) upgrades itself, with the bytes it held back. ``server_hostname``: the
    name a client's ClientHello carries (exo-tui's clients: a slot cookie, :mod:`exo_tui.net.slot`)."""
    protocol = getattr(writer, "_protocol", None)
    if protocol is not None and hasattr(protocol, "_over_ssl"):
        protocol._over_ssl = True
    if isinstance(protocol, TLSFirst):
        await protocol.upgrade(writer, ctx)
    else:
        await writer.start_tls(ctx, server_hostname=server_hostname)


def error_text(e: BaseException) -> str:
    """An exception's text, never empty (``ssl`` and ``ConnectionResetError`` often have none)."""
    if isinstance(e, ssl.SSLError) and getattr(e, "reason", None):
        return str(e.reason).lower().replace("_", " ")
    return str(e) or type(e).__name__


def is_tls_alert(e: ssl.SSLError) -> bool:
    """Whether the peer ended the TLS handshake with an alert (it refused something of ours, such
    as our certificate). ``ssl`` raises no type of its own for it: OpenSSL's reason code says it
    (``TLSV1_ALERT_UNKNOWN_CA``, ``SSLV3_ALERT_BAD_CERTIFICATE``, ``TLSV13_ALERT_CERTIFICATE_REQUIRED``)."""
    reason = getattr(e, "reason", None) or ""
    return reason.startswith(TLS_ALERT_REASONS)


TLS_ALERT_REASONS = ("SSLV3_ALERT_", "TLSV1_ALERT_", "TLSV13_ALERT_")


def local_name(sec: Security) -> str:
    if sec.name == "coordinator":
        return "this coordinator"
    return f"this node ({sec.name})" if sec.name else "this process"


def peer_identity(writer: asyncio.StreamWriter) -> tuple[bytes, str]:
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


def format_address(addr: Any) -> str:
    """A socket address as ``host:port`` (``[host]:port`` for IPv6)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return host_port(str(addr[0]), addr[1])
    return str(addr or "?")


class TLSFirst(asyncio.StreamReaderProtocol):
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
        self._plain: asyncio.ReadTransport | None = None
        self.hello = asyncio.Event()  # set when a whole first TLS record arrived, or it never will
        self.not_tls = ""  # why the first bytes cannot be a TLS ClientHello
        self.first_record = b""  # the first TLS record (the ClientHello) once ``hello`` is set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._plain = cast(asyncio.ReadTransport, transport)  # a stream server's transport reads
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
            self.first_record = bytes(held[:5 + int.from_bytes(held[3:5], "big")])
            self.hello.set()
        elif len(held) > self.MAX_HELD:
            self._refuse(f"{len(held)} bytes before the TLS handshake (not a TLS client)")

    @property
    def client_hello_in(self) -> bool:
        """A whole first TLS record has arrived and the connection is still there (neither junk nor
        a connection already gone: what :class:`~exo_tui.net.gate.HandshakeGate` may not drop)."""
        return bool(self.first_record) and self._plain is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self._plain = None
        if not self.hello.is_set():
            self.not_tls = self.not_tls or "it closed the connection before its TLS ClientHello"
            self.hello.set()
        super().connection_lost(exc)

    def _refuse(self, why: str) -> None:
        self.not_tls = why
        self.hello.set()
        self._held = bytearray()  # nothing of it is wanted
        if self._plain is not None:
            self._plain.pause_reading()  # the accept task closes it

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
        buffered = cast(asyncio.BufferedProtocol, tls)  # uvloop's does not subclass it
        view = memoryview(held)
        while view:
            buf = memoryview(buffered.get_buffer(len(view)))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            buffered.buffer_updated(n)
            view = view[n:]
