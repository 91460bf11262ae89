"""Error frames, reading one back as an exception, and :class:`Dispatcher`, a handler that routes
frames by type. A :class:`~exo_tui.net.connection.Connection` answers a failed call with
:func:`error_frame`; :func:`remote_error` turns one received back into the
:class:`~exo_tui.net.errors.RemoteError` the caller raises."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from exo_tui.net.errors import RemoteError, UnknownFrameType
from exo_tui.net.frame import Frame

if TYPE_CHECKING:
    from exo_tui.net.connection import Connection

Handler = Callable[["Connection", Frame], Awaitable[Frame | None]]


def error_frame(message: str, code: str = "error", detail: dict[str, int | float | str] | None = None) -> Frame:
    return Frame("error", {"message": message, "code": code, **({"detail": detail} if detail else {})})


def remote_error(frame: Frame) -> RemoteError:
    """The exception an ``error`` frame stands for (its message, code and scalar details)."""
    body = frame.body if isinstance(frame.body, dict) else {}
    message = body.get("message")
    code = body.get("code")
    cls = UnknownFrameType if code == UnknownFrameType.code else RemoteError
    detail = body.get("detail")
    detail = {str(k): v for k, v in detail.items() if type(v) in (int, float, str)} if isinstance(detail, dict) else None
    return cls(
        str(message) if message is not None else "error without a message",
        code=str(code) if code is not None else None,
        detail=detail,
    )


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
