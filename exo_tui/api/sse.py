"""Server-sent events: the headers of a stream, the framing of one event, and how the OpenAPI
document describes a stream's events."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# One server-sent event (OpenAPI before 3.2 has ``schema`` describe each event of a stream).
SSE_200 = {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON object, or [DONE] at the end"},
                   "event": {"type": "string"}, "id": {"type": "string"}},
}}}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_template(obj: Any) -> Callable[[str], str]:
    """``sse`` of ``obj`` whose one ``"\0"`` string is each call's argument: the event of a
    streamed token is one JSON string formatted into text made once, not a dict encoded whole."""
    before, after = sse(obj).split('"\\u0000"')
    return lambda text: before + json.dumps(text) + after
