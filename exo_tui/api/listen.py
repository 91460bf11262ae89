"""The API's listening socket, bound before anything heavy is imported.

``exo-tui serve`` binds it first thing, so that a client started with it can connect at once:
the kernel queues its connection while the server imports, starts its nodes and plans, and the
request is then served (it waits for the plan: :func:`exo_tui.cluster.admission.wait_for_plan`).
"""

from __future__ import annotations

import socket


class ApiServerError(RuntimeError):
    """The API could not start; the message says why and what to do."""


def bind_api_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (raises :class:`ApiServerError` saying what to do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ApiServerError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): another exo-tui serve may be "
            f"running there (exo-tui status); pick another address with --api-host/--api-port"
        ) from exc
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock
