"""Exceptions of the network layer, in one place.

::

    ConnectionError
     ├── ConnectError            could not open a connection (refused, unreachable, timed out)
     │    └── HandshakeError     the connection opened but TLS or the HMAC handshake failed
     │         ├── AuthError         wrong cluster key, no key, replayed handshake, certificate refused
     │         └── ProtocolMismatch  the two sides speak different protocol versions
     └── ConnectionClosed        a call could not complete because the connection closed
    Exception
     └── RemoteError             the peer answered a call with an ``error`` frame
          ├── UnknownFrameType   raised by a dispatcher for a type it has no handler for
          └── BadBody            a frame's body does not fit its message (exo_tui.net.codec)

:class:`exo_tui.net.frame.FrameError` (a broken frame) is raised inside the read loop only: the
connection is closed with an ``error`` frame, and pending calls fail with :class:`ConnectionClosed`.
"""

from __future__ import annotations


class ConnectError(ConnectionError):
    """Could not open a connection to a peer."""


class HandshakeError(ConnectError):
    """TLS or the authentication handshake failed."""


class AuthError(HandshakeError):
    """The peer could not prove the cluster key (or we could not prove ours to it)."""


class ProtocolMismatch(HandshakeError):
    """The two sides speak different protocol versions."""

    def __init__(self, message: str, *, peer_version: int | None = None) -> None:
        super().__init__(message)
        self.peer_version = peer_version


class ConnectionClosed(ConnectionError):
    """The connection closed before a call completed (or a call was made on a closed connection)."""


class RemoteError(Exception):
    """An ``error`` frame: the peer could not do what was asked. ``code`` is machine-readable.

    Handlers may raise it (or a subclass) to answer a call with a clean error message; any other
    exception is answered too, with code ``handler_error``, and logged with its traceback.
    ``detail``: plain values the caller acts on (a refused load's ``need_bytes`` and ``room_bytes``).
    """

    code = "error"

    def __init__(self, message: str, *, code: str | None = None, detail: dict[str, int | float | str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = dict(detail or {})
        if code is not None:
            self.code = code


class UnknownFrameType(RemoteError):
    code = "unknown_type"


class BadBody(RemoteError):
    """A frame's body does not fit its message (:mod:`exo_tui.net.codec`); the message names the op
    and the field. Raised by a handler, it is answered with one ``error`` frame, a one-way frame's
    too (the sender learns what it sent wrong; the connection stays open)."""

    code = "bad_body"
