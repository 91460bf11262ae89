"""Running the API with uvicorn inside the coordinator's event loop.

:class:`ApiServer` binds the socket itself (so "address in use" is an error that says what to
do, not a log line and ``sys.exit``), runs ``uvicorn.Server.serve`` as a task of the running
loop, and leaves signal handling to the command that owns the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from exo_tui.api.app import create_app
from exo_tui.api.connections import ConnectionBook, connection_cap, guarded_protocol
from exo_tui.api.guard import DEFAULT_MAX_BODY_BYTES
from exo_tui.api.listen import ApiServerError, bind_api_socket
from exo_tui.net.address import host_port, is_loopback

log = logging.getLogger("exo_tui.api")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the command's run_main handles SIGTERM/SIGINT
        yield


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when the API listens beyond this machine with no key."""
    if api_key or is_loopback(host):
        return None
    return (f"warning: the API listens on {host} without an API key: anyone who can reach this address can use "
            f"and change the cluster; set network.api.key in the config or EXO_TUI_API_KEY")


class ApiServer:
    def __init__(self, coordinator: Any, *, host: str = "127.0.0.1", port: int = 52415, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "warning", graceful_s: int = 3,
                 sock: socket.socket | None = None, app: Any = None) -> None:
        """``app``: an ASGI app to serve instead of ``create_app(coordinator)`` (a coordinator set's,
        :mod:`exo_tui.api.forwarding`); it has ``state.closing`` as create_app's has."""
        self.coordinator = coordinator
        self.host, self.port, self.api_key = host, port, api_key
        self.app = app if app is not None else create_app(coordinator, api_key=api_key, max_body_bytes=max_body_bytes)
        self.connections = ConnectionBook(connection_cap())  # the cap and the header timeout
        self._config = uvicorn.Config(self.app, log_level=log_level, lifespan="off", access_log=False,
                                      timeout_graceful_shutdown=graceful_s, http=guarded_protocol(self.connections))
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = sock  # bound already (exo-tui serve binds it first thing)

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    async def start(self) -> None:
        sock = self._sock if self._sock is not None else bind_api_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="api-server")
        while not self._server.started:
            if self._task.done():
                exc = self._task.exception() if not self._task.cancelled() else None
                raise ApiServerError(f"the API server stopped while starting: {exc!r}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.app.state.closing.set()
        self._server.should_exit = True
        try:
            async with asyncio.timeout((self._config.timeout_graceful_shutdown or 3.0) + 2.0):
                await asyncio.shield(self._task)
        except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sock is not None:
            self._sock.close()
        self._task = None

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
