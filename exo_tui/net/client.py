"""The connecting side: :func:`connect` → :class:`~exo_tui.net.connection.Connection`, and
:func:`open_authenticated` for tools and tests that speak raw bytes after the handshake.

A failure says which step failed and what it means: :class:`ConnectError` (not reachable),
:class:`HandshakeError` from TLS (another cluster's certificate, TLS off on one side, a node busy
refusing handshakes), :class:`AuthError` (wrong cluster key, certificate refused). See
:mod:`exo_tui.net.server` for an example of both sides.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Collection

from exo_tui.net import auth
from exo_tui.net.address import host_port
from exo_tui.net.connection import MAX_CONCURRENT_CALLS, STREAM_LIMIT, Connection
from exo_tui.net.dispatcher import Handler
from exo_tui.net.errors import AuthError, ConnectError, HandshakeError
from exo_tui.net.frame import DEFAULT_LIMITS, Limits
from exo_tui.net.security import Security
from exo_tui.net.slot import slot_cookie
from exo_tui.net.transport import error_text, is_tls_alert, local_name, peer_identity, start_tls, tune_socket

BUSY_RETRIES = (0.05, 0.15, 0.4)  # the pauses before connecting again to a node that dropped us unanswered


def _dropped(e: BaseException) -> bool:
    """Whether the peer closed or reset the connection before answering the ClientHello: a node
    under a flood drops the oldest connection whose ClientHello it has not received to make room
    (:mod:`exo_tui.net.gate`), and ours, sent late by a busy loop, can be that one."""
    return not isinstance(e, ssl.SSLError) or isinstance(e, ssl.SSLEOFError)


def _tls_refusal(peer: str, e: BaseException) -> HandshakeError:
    """What a failed client-side TLS handshake means, from how it failed."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return HandshakeError(
            f"TLS handshake with {peer} failed ({e.verify_message or error_text(e)}): its certificate is not from "
            "this cluster's CA (another cluster's node, or not a node of ours)"
        )
    if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
        if is_tls_alert(e):
            return AuthError(f"{peer} refused this side's certificate during TLS ({error_text(e)}): it is not from "
                             "that node's cluster CA")
        return HandshakeError(
            f"TLS handshake with {peer} failed ({error_text(e)}): TLS is off on one side "
            "(network.security.enable_tls), or it is not an exo-tui node agent"
        )
    # The peer closed or reset the connection before answering the ClientHello: what a node does
    # to connections it has no handshake slot for (or a server that is not TLS at all).
    return HandshakeError(
        f"{peer} closed the connection before the TLS handshake ({error_text(e)}): the node is busy refusing "
        "handshakes (too many connections at once: someone may be flooding its port; see its log), "
        "or it is not an exo-tui node agent"
    )


async def open_authenticated(
    host: str, port: int, *, security: Security, timeout: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """TCP, TLS and the HMAC handshake, without the frame layer: ``(reader, writer, peer_name)``.

    A node that closes the connection before answering the ClientHello (a node under a flood drops
    connections whose ClientHello has not arrived to make room) is tried again, up to
    ``len(BUSY_RETRIES)`` times within ``timeout``. For tools and tests that speak raw bytes;
    applications use :func:`connect`. Raises like it.
    """
    peer = host_port(host, port)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            for pause in (*BUSY_RETRIES, None):
                try:
                    reader, writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
                except OSError as e:
                    raise ConnectError(
                        f"cannot connect to {peer}: {e.strerror or e}: is the node agent running there "
                        "(exo-tui node) and the port reachable?"
                    ) from None
                tune_socket(writer)
                fp_server, name = b"", ""
                if not security.enable_tls:
                    break
                try:
                    # the slot cookie: a node under a flood of strangers still gives this side a slot
                    # once its ClientHello is in
                    await start_tls(writer, security.client_context(), slot_cookie(security.cluster_key))
                except (ssl.SSLError, ConnectionError, OSError) as e:
                    writer.transport.abort()
                    if pause is None or not _dropped(e):
                        raise _tls_refusal(peer, e) from None
                    await asyncio.sleep(pause)
                    continue
                fp_server, name = peer_identity(writer)
                break
            assert writer is not None  # the loop above ends with a connection or raises
            try:
                await auth.client_handshake(
                    reader, writer, security.cluster_key, fp_server=fp_server,
                    fp_client=security.fingerprint if security.enable_tls else b"",
                    peer=f"node {peer}" if security.name == "coordinator" else peer, local=local_name(security),
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
        peer=host_port(host, port), peer_name=name,
        max_concurrent_calls=max_concurrent_calls, inline_types=inline_types,
    )
    conn.start()
    return conn
