"""The API's connections, bounded (exo_tui/api/connections.py): a real uvicorn server on loopback
with a cap of 2 and a short header timeout, and raw sockets as clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from exo_tui.api.connections import ConnectionBook, guarded_protocol

REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class App:
    """``/`` answers at once; ``/wait`` answers once ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/wait":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def serving(book: ConnectionBook, app: App) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", http=guarded_protocol(book))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        app.release.set()
        server.should_exit = True
        await task
        sock.close()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends before it closes the connection (a hung test fails by timeout)."""
    async with asyncio.timeout(10):
        return await reader.read()


async def test_at_the_cap_the_oldest_idle_connection_makes_room() -> None:
    book = ConnectionBook(cap=2)
    async with serving(book, App()) as port:
        first, second = await _open(port), await _open(port)  # neither sends a request: idle
        r3, w3 = await _open(port)
        w3.write(REQUEST)
        assert (await r3.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert await _closed(first[0]) == b""  # the oldest idle one went
        assert book.dropped == 1
        second[1].write(REQUEST)
        assert (await second[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        for w in (first[1], second[1], w3):
            w.close()


async def test_when_every_connection_is_busy_a_newcomer_is_told_so() -> None:
    book, app = ConnectionBook(cap=2), App()
    async with serving(book, app) as port:
        busy = [await _open(port) for _ in range(2)]
        for _, w in busy:
            w.write(REQUEST.replace(b"/ ", b"/wait "))
        while len(book.idle) or book.open < 2:
            await asyncio.sleep(0.01)
        reader, writer = await _open(port)
        answer = await _closed(reader)
        assert answer.startswith(b"HTTP/1.1 503") and book.refused == 1
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "too_many_connections" and "2 connections open" in error["message"]
        app.release.set()
        for r, w in busy:
            assert (await r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            w.close()
        writer.close()


@pytest.mark.parametrize("slowly", [False, True])
async def test_headers_must_be_whole_within_the_header_timeout(slowly: bool) -> None:
    """Silent, or a byte at a time (uvicorn's own keep-alive timer restarts at every byte)."""
    book = ConnectionBook(cap=8, header_s=0.5)
    async with serving(book, App()) as port:
        reader, writer = await _open(port)

        async def trickle() -> None:
            for byte in REQUEST[:-2]:
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)

        feeder = asyncio.create_task(trickle()) if slowly else None
        assert await _closed(reader) == b""
        if feeder is not None:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await feeder
        writer.close()
        async with asyncio.timeout(10):
            while book.open:
                await asyncio.sleep(0.01)
