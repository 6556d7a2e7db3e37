"""The HTTP edge: who may send a management request, and how many bytes a request may send.

FastAPI parses a multipart form before it runs a route's dependencies, so checks in the route come
too late: an upload to POST /adapters without a token would be spooled to the temp directory in full
and only then answered 401, and /classify would read a whole oversized body before its 413.
``EdgeMiddleware`` (pure ASGI) runs before any of that:

- POST /adapters and DELETE /adapters/{name}: ``check_admin`` (server/deps.py, the one rule, also
  run by the routes' ``require_admin``) on the headers alone; a refusal is sent before a byte of the
  body is read.
- Routes that take a body have a cap on the whole body (``body_caps``): a Content-Length over it is
  answered 413 at once; otherwise bytes are counted as ``receive`` hands them over, and the request
  is answered 413 as soon as the count passes the cap (chunked uploads included). uvicorn reads the
  socket only as fast as the app calls ``receive`` (flow control), so nothing much past the cap is
  read into memory or spooled to disk.

Every refusal carries ``connection: close``: the unread rest of the body is dropped with the
connection instead of being read to keep it alive. The per-file checks in the routes stay; these caps
only bound the request as a whole.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from types import SimpleNamespace

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .deps import check_admin
from .errors import RequestTooLargeError, ServiceError, error_body, status_of
from .settings import Settings

log = logging.getLogger("memvit.server.edge")

# Room for what a multipart body carries besides the files: boundaries, part headers (file names
# included), small form fields. Generous for the few parts these routes take, tiny next to the caps.
MULTIPART_ALLOWANCE = 64 * 1024

_DELETE_ADAPTER = re.compile(r"/adapters/[^/]+")


@dataclass(frozen=True)
class BodyCap:
    """The most bytes a route's whole request body may hold, and what to tell a client over it."""

    limit: int
    why: str

    def error(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"the request body is over the {self.limit}-byte limit: {self.why}")


def body_caps(settings: Settings) -> dict[tuple[str, str], BodyCap]:
    """(method, path) -> cap, for every route that takes a body."""
    images, per_image = settings.max_images_per_request, settings.max_image_bytes
    return {
        ("POST", "/adapters"): BodyCap(
            settings.max_bundle_bytes + MULTIPART_ALLOWANCE,
            f"a bundle over the {settings.max_bundle_bytes}-byte upload limit",
        ),
        ("POST", "/classify"): BodyCap(
            images * per_image + MULTIPART_ALLOWANCE,
            f"at most {images} images of at most {per_image} bytes each",
        ),
    }


def is_management(method: str, path: str) -> bool:
    """The requests that change the adapter set (POST /adapters, DELETE /adapters/{name})."""
    return (method == "POST" and path == "/adapters") or (
        method == "DELETE" and _DELETE_ADAPTER.fullmatch(path) is not None
    )


class EdgeMiddleware:
    """Admin check before the body, and a streaming byte cap on every body (see the module's doc)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.caps = body_caps(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], _route_path(scope)
        headers = Headers(scope=scope)
        if is_management(method, path):
            try:
                check_admin(self.settings, headers.get("authorization"))
            except ServiceError as exc:
                await _refuse(scope, send, exc, "/adapters" if method == "POST" else "/adapters/{name}")
                return
        cap = self.caps.get((method, path))
        if cap is None:
            await self.app(scope, receive, send)
            return
        length = _content_length(headers)
        if length is not None and length > cap.limit:
            await _refuse(scope, send, cap.error(), path)
            return
        await self._capped(scope, receive, send, cap)

    async def _capped(self, scope: Scope, receive: Receive, send: Send, cap: BodyCap) -> None:
        received = 0
        response_started = False
        answered = False  # the 413 went out: what the app sends after it is dropped
        over = False

        async def receive_capped() -> Message:
            nonlocal received, answered, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap.limit:
                    # Stop reading here; to the app the client has left (as in server/timeouts.py).
                    over = True
                    if not response_started:
                        answered = True
                        await _refuse(scope, send, cap.error(), None)
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_answered(message: Message) -> None:
            nonlocal response_started
            if answered:
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        await self.app(scope, receive_capped, send_unless_answered)


def _route_path(scope: Scope) -> str:
    # Behind a proxy prefix (--root-path) uvicorn puts the prefix in `path`; routes match without it.
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None  # none (chunked) or unparseable: the streaming count still applies


async def _refuse(scope: Scope, send: Send, exc: ServiceError, route: str | None) -> None:
    """Answers ``exc`` in the standard error shape and asks uvicorn to close the connection.
    ``route``: the template of the route the request was meant for, when the router never saw it."""
    status = status_of(exc)
    log.debug("%d on %s %s: %s", status, scope["method"], scope["path"], exc)
    if route is not None:
        # Metrics label requests by route template; without this one they would read "unmatched".
        scope.setdefault("route", SimpleNamespace(path=route))
    body = json.dumps(error_body(exc, status)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in (exc.headers() or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
