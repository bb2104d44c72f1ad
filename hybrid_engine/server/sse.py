"""Server-sent events: one ``data: <json>`` event per chunk, ``data: [DONE]`` at the end."""
from __future__ import annotations

import json

from .protocol import ApiError

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(err: ApiError) -> str:
    """An error after the stream began (the status line is already sent): an ``error`` event."""
    return sse_event(err.body())
