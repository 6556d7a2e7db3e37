"""``GuardMiddleware``: the route table (routes.py) applied to every request, before the app reads it.

For each request, in order, from its headers alone:
1. the Host header names this server (origin.py; 400), for every request, routes or not;
2. who is calling (principal.py), stored in ``scope["state"]`` for the routes;
3. for a route that changes state, that no other site's page sent it (origin.py; 403);
4. who may call the route (access.py): a refusal (401/403) is sent before a byte of the body is read;
5. the body cap: a Content-Length over it is answered 413 at once;
6. for a route that runs images (``metered``), the caller's limits (server/tenancy/limits.py): at its
   requests-in-flight limit or with an empty token bucket, 429 with ``Retry-After``; admitted, a
   ticket in ``scope["state"]`` that the route charges once it has counted the images, and that
   holds the request's in-flight slot until the app is done;
7. then the app runs with ``receive``/``send`` wrapped once (body.py): the body's deadline (408) and
   the cap again while the body streams (413), for chunked bodies and lying Content-Lengths.

Every refusal carries ``connection: close`` (the unread rest of the body goes with the connection)
and the standard error body (``send_error``). Every request to a state-changing route, refused or
served, leaves one audit record (server/tenancy/audit.py) with the status it got. Routes then only read
input the guard let through.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ServiceError
from ..settings import Settings
from ..telemetry.metrics import EDGE_DONE, Metrics
from ..tenancy.audit import AuditEntry, action_of, record
from ..tenancy.limits import Limiter, Ticket
from .access import check_access
from .body import BodyLimits, content_length
from .errors import status_of
from .origin import OriginPolicy
from .principal import Credentials, set_principal
from .routes import Route, route_table
from .send import send_error

log = logging.getLogger("memvit.server.edge")


# ``EDGE_DONE`` is set in a request's scope by a route served outside the middleware stack (the raw
# ``/classify``, server/edge/classify_route.py) that applied the edge itself and hands the request to
# the app: the guard and the metrics pass it on as it is.


class Edge:
    """The guard's checks of one request from its headers (steps 1-6 of the module's doc), for the
    middleware and for the raw ``/classify`` route, which shares this object (and so its limits)."""

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, limiter: Limiter | None = None
    ) -> None:
        """``limiter``: where the keys' limits are kept (default: in this process)."""
        self.settings = settings
        self.metrics = metrics  # for the audit counter
        self.table = route_table(settings)
        self.origins = OriginPolicy(settings)
        self.credentials = Credentials(settings)  # reads the keys file: a bad one fails at start-up
        self.limiter = limiter if limiter is not None else Limiter(metrics)

    async def admit(
        self, scope: Scope, headers: Headers, row: Route, path: str, audit: AuditEntry | None = None
    ) -> Ticket | None:
        """The principal (in ``scope["state"]``) and, for a metered route, the caller's ticket; or the
        ``ServiceError`` that refuses the request."""
        self.origins.check_host(headers, scope.get("http_version", "1.1"))
        principal = self.credentials.resolve(headers.get("authorization"))
        if audit is not None:
            audit.key = principal.id
        if row.changes_state:
            self.origins.check_origin(headers, scope.get("scheme", "http"))
        principal = check_access(row, self.settings, principal, self.table.name_in(row, path))
        set_principal(scope, principal)
        _check_length(row, headers)
        if not row.metered:
            return None
        # last: a request refused for any other reason takes no slot
        ticket = await self.limiter.admit_async(principal.id, self.credentials.policy(principal))
        scope["state"]["ticket"] = ticket
        return ticket


class GuardMiddleware:
    """Host, origin, access, body cap and body deadline, per route, from one table (see the module's doc)."""

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        metrics: Metrics | None = None,
        limiter: Limiter | None = None,
        edge: Edge | None = None,
    ) -> None:
        """``edge``: the checks (default: new ones, with ``limiter`` or limits kept here)."""
        self.app = app
        self.edge = edge if edge is not None else Edge(settings, metrics, limiter)
        self.table = self.edge.table
        self.metrics = self.edge.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or EDGE_DONE in scope:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], route_path(scope)
        route = self.table.find(method, path)
        if route is None or not route.changes_state:
            await self._guard(scope, receive, send, route, path, None)
            return
        audit = AuditEntry(
            action_of(method, scope.get("query_string", b"")), self.table.name_in(route, path) or "-"
        )
        scope.setdefault("state", {})["audit"] = audit  # the route adds the bundle's name and sha256
        status = "none"

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self._guard(scope, receive, watched, route, path, audit)
        except Exception:  # the app failed before answering: the client gets ServerErrorMiddleware's 500
            status = "500" if status == "none" else status
            raise
        finally:
            record(audit, status, self.metrics)

    async def _guard(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: Route | None,
        path: str,
        audit: AuditEntry | None,
    ) -> None:
        row = route or self.table.fallback(scope["method"], path)  # no route: the router answers 404/405
        try:
            ticket = await self.edge.admit(scope, Headers(scope=scope), row, path, audit)
        except ServiceError as exc:
            await refuse(scope, send, exc, route)
            return

        async def refused(error: ServiceError) -> None:
            await _refuse(scope, send, error)

        body = BodyLimits(receive, send, seconds=row.deadline, cap=row.cap, refuse=refused)
        try:
            await self.app(scope, body.receive, body.send)
        finally:
            body.close()
            if ticket is not None:
                ticket.release()


async def refuse(scope: Scope, send: Send, exc: ServiceError, route: Route | None) -> None:
    """Answers a refusal by the edge (``Edge.admit``)."""
    if route is not None:
        # Metrics label requests by route template; the router never saw this one, and without
        # the label it would read "unmatched".
        scope.setdefault("route", SimpleNamespace(path=route.path))
    await _refuse(scope, send, exc)


def _check_length(route: Route, headers: Headers) -> None:
    length = content_length(headers)
    if route.cap is not None and length is not None and length > route.cap.limit:
        raise route.cap.error()


def route_path(scope: Scope) -> str:
    # Behind a proxy prefix (--root-path) uvicorn puts the prefix in `path`; routes match without it.
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _refuse(scope: Scope, send: Send, exc: ServiceError) -> None:
    """Answers ``exc`` and asks uvicorn to close the connection (the rest of the body is not read)."""
    status = status_of(exc)
    log.debug("%d on %s %s: %s", status, scope["method"], scope["path"], exc)
    await send_error(send, status, exc, {"connection": "close", **(exc.headers() or {})})
