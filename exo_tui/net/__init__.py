"""The wire: frames, cluster secrets, the authentication handshake and the RPC layer.

The public API, importable from here:

* frames — :class:`Frame`, :class:`Limits`, :data:`PROTOCOL_VERSION`, :data:`DTYPES`
* secrets — :class:`Security` (what ``serve``/``connect`` need), :func:`ensure_cluster` /
  :class:`Cluster` (coordinator: CA, cluster key, node certificates and bundles),
  :func:`write_node_bundle`, :func:`home_dir`, :func:`default_bundle_path`
* RPC — :func:`serve` → :class:`Server` (:mod:`exo_tui.net.server`), :func:`connect`
  (:mod:`exo_tui.net.client`) → :class:`Connection` and :class:`Dispatcher`
  (:mod:`exo_tui.net.connection`, :mod:`exo_tui.net.dispatcher`); the TCP and TLS setup both sides share is
  :mod:`exo_tui.net.transport`
* errors — :class:`ConnectError`, :class:`HandshakeError`, :class:`AuthError`,
  :class:`ProtocolMismatch`, :class:`ConnectionClosed`, :class:`RemoteError`,
  :class:`UnknownFrameType`, :class:`FrameError`, :class:`SecurityError`

See :mod:`exo_tui.net.server` for an example.
"""

from exo_tui.net.client import connect
from exo_tui.net.connection import Connection
from exo_tui.net.dispatcher import Dispatcher, error_frame
from exo_tui.net.errors import (
    AuthError,
    ConnectError,
    ConnectionClosed,
    HandshakeError,
    ProtocolMismatch,
    RemoteError,
    UnknownFrameType,
)
from exo_tui.net.frame import DTYPES, PROTOCOL_VERSION, Frame, FrameError, Limits
from exo_tui.net.security import (
    Cluster,
    Security,
    SecurityError,
    default_bundle_path,
    ensure_cluster,
    home_dir,
    write_node_bundle,
)
from exo_tui.net.server import Server, serve

__all__ = [
    "DTYPES",
    "PROTOCOL_VERSION",
    "AuthError",
    "Cluster",
    "ConnectError",
    "Connection",
    "ConnectionClosed",
    "Dispatcher",
    "Frame",
    "FrameError",
    "HandshakeError",
    "Limits",
    "ProtocolMismatch",
    "RemoteError",
    "Security",
    "SecurityError",
    "Server",
    "UnknownFrameType",
    "connect",
    "default_bundle_path",
    "ensure_cluster",
    "error_frame",
    "home_dir",
    "serve",
    "write_node_bundle",
]
