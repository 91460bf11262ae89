"""The API's front door: the key is checked from the headers, and bodies are capped, before any
body byte is read.

:class:`ApiGuard` is a plain ASGI middleware around the whole app (so ``/docs`` and
``/openapi.json`` are behind the key too). With a key set, a request without it (or with another)
is answered ``401`` from its headers alone: its body is never read, and the connection is closed.
Every body is limited to ``max_body_bytes``: a ``Content-Length`` past it is answered ``413`` at
once; a body without one (chunked) is counted as its chunks arrive and stopped at the limit with a
``413``. Nothing past the limit is kept, so a stranger's 200 MB POST costs the server at most the
limit (and a 64 KiB read buffer).

A refused request's remaining body is read and thrown away, chunk by chunk, for at most
``DRAIN_S`` seconds (``DRAIN_BYTES`` bytes), before the answer: a server that closes a connection
with unread bytes makes the kernel reset it, and the reset destroys the answer before a client that
is still sending can read it (on Linux, every time). Past those bounds the connection is closed.
A client waiting for ``100 Continue`` is answered at once instead, and never sends the body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.exceptions import HTTPException

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a chat of several thousand tokens is a few hundred KB
DRAIN_S = 10.0
DRAIN_BYTES = 1 << 30

Scope = dict[str, Any]


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes the limit (the app answers it ``413``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(network.api.max_body_bytes): send a smaller request")


def _header(scope: Scope, name: bytes) -> bytes | None:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def bearer_key(scope: Scope) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header, or ``None``."""
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, key = value.strip().partition(b" ")
    return key.strip() if scheme.lower() == b"bearer" and key.strip() else None


async def drain(receive: Any, more: bool = True) -> bool:
    """Read and drop the rest of a request body (see the module doc); ``False`` when it had to stop early."""
    deadline, seen = time.monotonic() + DRAIN_S, 0
    while more:
        left = deadline - time.monotonic()
        if left <= 0 or seen > DRAIN_BYTES:
            return False
        try:
            async with asyncio.timeout(left):
                message = await receive()
        except TimeoutError:
            return False
        if message["type"] != "http.request":
            return False  # the client went away
        seen += len(message.get("body", b""))
        more = message.get("more_body", False)
    return True


async def _answer(send: Any, status: int, message: str, code: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """An OpenAI-shaped error, closing the connection (the unread body is not wanted)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _has_body(scope: Scope) -> bool:
    """Whether a body follows that must be drained before answering (not when the client waits
    for ``100 Continue``: answered at once, it never sends the body)."""
    if (_header(scope, b"expect") or b"").lower() == b"100-continue":
        return False
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() not in (b"0", b"")
    return _header(scope, b"transfer-encoding") is not None


class ApiGuard:
    """ASGI middleware: the API key from the headers, then a cap on the body (see the module doc)."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")
        self.app = app
        self.state: Any = getattr(app, "state", None)  # the app's, where a server reads it through the guard
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None:
            key = bearer_key(scope)
            if key is None or not hmac.compare_digest(key, self.api_key):
                await drain(receive, _has_body(scope))
                why = ("this server needs an API key: send it as 'Authorization: Bearer KEY'" if key is None else
                       "incorrect API key provided: use the key in network.api.key or EXO_TUI_API_KEY of the "
                       "coordinator")
                await _answer(send, 401, why, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        limit = self.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await drain(receive)
                await _answer(send, 400, "the Content-Length header is not a number", "invalid_request")
                return
            if declared > limit:
                await drain(receive, _has_body(scope))
                await _answer(send, 413, str(BodyTooLarge(limit).detail), "body_too_large")
                return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    await drain(receive, message.get("more_body", False))
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if seen > limit:  # the app answered the 413: no keep-alive with half a body unread
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge as e:  # raised past the app's own handlers
            if started:
                raise
            await _answer(send, 413, str(e.detail), "body_too_large")
