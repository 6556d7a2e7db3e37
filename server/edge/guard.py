"""``GuardMiddleware``: the route table (routes.py) applied to every request, before the app reads it.

For each request, in order, from its headers alone:
1. who may call the route (access.py): a refusal (401/403) is sent before a byte of the body is read;
2. the body cap: a Content-Length over it is answered 413 at once;
3. then the app runs with ``receive``/``send`` wrapped once (body.py): the body's deadline (408) and
   the cap again while the body streams (413), for chunked bodies and lying Content-Lengths.

Every refusal carries ``connection: close`` (the unread rest of the body goes with the connection)
and the standard error body (``send_error``). Routes then only read input the guard let through.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ServiceError, status_of
from ..settings import Settings
from .access import check_access
from .body import BodyLimits, content_length
from .routes import Route, route_table
from .send import send_error

log = logging.getLogger("memvit.server.edge")


class GuardMiddleware:
    """Access, body cap and body deadline, per route, from one table (see the module's doc)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.table = route_table(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], _route_path(scope)
        route = self.table.find(method, path)
        if route is None:
            route = self.table.fallback(method, path)
        else:
            try:
                _check_headers(route, self.settings, Headers(scope=scope))
            except ServiceError as exc:
                # Metrics label requests by route template; the router never saw this one, and without
                # the label it would read "unmatched".
                scope.setdefault("route", SimpleNamespace(path=route.path))
                await _refuse(scope, send, exc)
                return

        async def refuse(error: ServiceError) -> None:
            await _refuse(scope, send, error)

        body = BodyLimits(receive, send, seconds=route.deadline, cap=route.cap, refuse=refuse)
        await self.app(scope, body.receive, body.send)


def _check_headers(route: Route, settings: Settings, headers: Headers) -> None:
    check_access(route, settings, headers)
    length = content_length(headers)
    if route.cap is not None and length is not None and length > route.cap.limit:
        raise route.cap.error()


def _route_path(scope: Scope) -> str:
    # Behind a proxy prefix (--root-path) uvicorn puts the prefix in `path`; routes match without it.
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _refuse(scope: Scope, send: Send, exc: ServiceError) -> None:
    """Answers ``exc`` and asks uvicorn to close the connection (the rest of the body is not read)."""
    status = status_of(exc)
    log.debug("%d on %s %s: %s", status, scope["method"], scope["path"], exc)
    await send_error(send, status, exc, {"connection": "close", **(exc.headers() or {})})
