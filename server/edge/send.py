"""The service's one error shape, ``{"error": {"type", "message", "field"?}}``, and ``send_error``.

``error_json`` builds every error body: the FastAPI exception handlers (server/edge/errors.py), the
guard's refusals (401/403/413/408, server/edge/guard.py), the header deadline's raw 408
(server/http/timeouts.py) and the Ray proxy's 503 (server/ray/proxy.py). ``send_error`` sends one at the
ASGI level, before or instead of the app's response.

It imports neither torch nor the model: the Ray proxy process loads it, and must stay light.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.types import Send


def error_json(kind: str, message: str, field: str | None = None) -> dict[str, dict[str, str]]:
    """The error body: the error's type, its message, and the request field at fault if one is."""
    body = {"type": kind, "message": message}
    if field:
        body["field"] = field
    return {"error": body}


def error_body(exc: BaseException, status: int) -> dict[str, dict[str, str]]:
    """``exc`` answered with ``status``. A 5xx says only "internal error" (its details are for the log)
    unless the error is an expected condition (``expected = True``: not ready, overloaded)."""
    shown = status < 500 or getattr(exc, "expected", False)
    field = getattr(exc, "field", None) if shown else None
    return error_json(type(exc).__name__, str(exc) if shown else "internal error", field)


def error_bytes(exc: BaseException, status: int) -> bytes:
    """``error_body`` as the bytes of a response body."""
    return json.dumps(error_body(exc, status)).encode()


async def send_error(
    send: Send, status: int, error: BaseException, headers: Mapping[str, str] | None = None
) -> None:
    """Answers ``error`` with ``status`` in the standard shape; ``headers`` (names in any case) go on
    the response after content-type and content-length."""
    body = error_bytes(error, status)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
