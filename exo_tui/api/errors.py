"""The API's errors, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

:class:`ApiError` is what a route raises; :func:`add_error_handlers` answers it, and every other
failure (a body FastAPI could not validate, an unknown path, a bug), in that shape;
:func:`documented_errors` describes a route's error statuses in the OpenAPI document.
The statuses and what each means are listed in :mod:`exo_tui.api.app`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from exo_tui.api import schemas as s
from exo_tui.api.guard import BodyTooLarge

log = logging.getLogger("exo_tui.api")

RETRY_AFTER_S = 2  # on a 503


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                              retry_after_s=self.retry_after_s)


def error_response(status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                   param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> JSONResponse:
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):  # busy; loading, no plan yet, no node reachable: clients that honour it retry then
        headers = {"Retry-After": str(retry_after_s or RETRY_AFTER_S)}
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def documented_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """A route's error statuses for the OpenAPI document (``responses=``)."""
    if 422 in codes:
        codes = (400, *codes)  # a body that is not JSON at all is a 400, as in OpenAI's API
    text = {400: "bad request", 401: "missing or wrong API key", 403: "read-only coordinator",
            404: "unknown model, node or host", 409: "the change is impossible now", 422: "invalid parameters",
            429: "too many requests waiting: try again after Retry-After seconds",
            502: "the host could not be bootstrapped", 503: "the cluster cannot serve the model"}
    return {c: {"model": s.ErrorResponse, "description": text[c]} for c in codes}


class ClientGone(Exception):
    """The client disconnected before its answer: the route stops (answered 499, read by nobody)."""


def add_error_handlers(app: FastAPI) -> None:
    """Answer :class:`ApiError`, invalid bodies, unknown paths and methods, and any other exception
    in OpenAI's error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" or (e.get("type") == "model_attributes_type" and tuple(e.get("loc", ())) == ("body",))
               for e in errors):
            return error_response(400, "the body is not a JSON object: send JSON with Content-Type: application/json",
                                  code="invalid_json")
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        param = ".".join(loc) or None
        parts = []
        for e in errors[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path")) or "body"
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
        return error_response(422, "invalid parameters: " + "; ".join(parts), param=param, code="invalid_parameter")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %r", exc, exc_info=exc)
        return error_response(500, f"internal error in the coordinator: {type(exc).__name__}: {exc}; see its log",
                              type="server_error", code="internal_error")

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = "no such path: see /docs for the API"
        elif exc.status_code == 405:
            message = f"method not allowed here: {exc.detail}"
        code = "body_too_large" if isinstance(exc, BodyTooLarge) else str(exc.status_code)
        return error_response(exc.status_code, message, code=code)
