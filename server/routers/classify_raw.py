"""``POST /classify`` as a raw ASGI route, before the middleware stack: the same answers, less CPU.

Through FastAPI a ``/classify`` request passed eight ASGI layers (three of FastAPI's, the metrics,
the protocol's error shape, the guard, the exception middleware, the router), a thread hop per
plain-function dependency, python-multipart, pydantic's validation of the parameters and of the
response, and a file stack to close: ~2.4 ms of CPU per request on this machine's cores, with the
pass and the pixels next to nothing (benchmarks/front_end_cpu.py). Here one coroutine does what the
layers did, in their order, with their code:

1. the metrics' stage timer (``RequestMeter``), counted under ``/classify`` as the middleware would;
2. the guard's checks from the headers (``Edge.admit``: host, caller, access, Content-Length, the
   key's limits), refusals answered as the guard answers them;
3. the body, read through the guard's ``BodyLimits`` (its cap and its one deadline);
4. the query and the multipart body read the short way (server/edge/form.py);
5. ``deps.classify_input`` and ``routers.classify.answer``, the FastAPI route's own functions;
6. the response's JSON as FastAPI serialises it (``pipeline.respond_json``: the same bytes, without
   building the models); errors answered by the app's own handlers' rules (server/edge/errors.py).

Anything the short way does not read (not multipart, not plain, still loading) goes to the app,
marked as admitted (``EDGE_DONE``), with the body already read handed back: FastAPI answers it as
before. The tests send every kind of request both ways and compare the bytes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from types import SimpleNamespace

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memvit.memory_core import MemvitError

from ..edge.body import BodyLimits
from ..edge.errors import status_of
from ..edge.form import ClassifyQuery, Upload, boundary_of, read_files, read_query
from ..edge.guard import Edge, refuse, route_path
from ..edge.send import error_body, error_json
from ..errors import ServiceError
from ..http.deps import classify_input
from ..http.state import AppState
from ..telemetry.metrics import EDGE_DONE, MeteredSend, RequestMeter
from ..telemetry.stages import begin_stages
from .classify import answer

log = logging.getLogger("memvit.server.errors")
PATH = "/classify"
_ROUTE = SimpleNamespace(path=PATH)  # the metrics' label, as the router would set it
_JSON = (b"content-type", b"application/json")
PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for a body it could not read


class MemvitAPI(FastAPI):
    """FastAPI, with ``outer`` (if set) wrapped around its middleware stack: a route served before
    every layer, which hands what it does not serve to the stack. Middleware added after
    ``create_app`` added its own (``own_middleware`` of them: a Ray replica's, server/ray/serve.py)
    wraps the route as it wraps the stack."""

    outer: Callable[[ASGIApp, list], ASGIApp] | None = None
    own_middleware = 0

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        added = self.user_middleware[: len(self.user_middleware) - self.own_middleware]
        return stack if self.outer is None else self.outer(stack, added)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.outer is None or not serves(scope):
            await super().__call__(scope, receive, send)
            return
        # Starlette's own call: FastAPI's adds its OpenTelemetry hooks, which ask the global
        # providers whether they are configured at every request, for a route that is not FastAPI's.
        scope["app"] = self
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        await self.middleware_stack(scope, receive, send)


def serves(scope: Scope) -> bool:
    """Whether ``scope`` is a request for the raw route."""
    return scope["type"] == "http" and scope["method"] == "POST" and route_path(scope) == PATH


class RawClassify:
    """The app as uvicorn sees it: ``POST /classify`` here, every other request to ``app``."""

    def __init__(
        self, app: ASGIApp, state: AppState, edge: Edge, meter: RequestMeter, added: list | None = None
    ) -> None:
        """``added``: middleware (Starlette's ``Middleware``) that wraps the app's own: it wraps this
        route too, outermost first, as it does in the stack."""
        self.app, self.state, self.edge, self.meter = app, state, edge, meter
        self.row = edge.table.find("POST", PATH)
        assert self.row is not None and self.row.metered, "POST /classify must be a metered route"
        self.route: ASGIApp = self._route
        for cls, args, kwargs in reversed(added or []):
            self.route = cls(self.route, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if serves(scope):
            await self.route(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = MeteredSend(send, self.meter, begin_stages())
        headers = Headers(scope=scope)
        try:
            try:
                ticket = await self.edge.admit(scope, headers, self.row, PATH)
            except ServiceError as exc:
                await refuse(scope, answer, exc, self.row)
                return
            try:
                await self._admitted(scope, receive, answer, headers.get("content-type", ""))
            finally:
                if ticket is not None:
                    ticket.release()
        finally:
            self.meter.observe(PATH, "POST", answer.status, answer.stages)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, content_type: str) -> None:
        async def refused(error: ServiceError) -> None:
            await refuse(scope, send, error, None)

        row = self.row
        body = BodyLimits(receive, send, seconds=row.deadline, cap=row.cap, refuse=refused)
        try:
            boundary = boundary_of(content_type)
            if boundary is None:  # FastAPI's way, which reads the body itself (or answers 415)
                await self._to_app(scope, body.receive, body.send)
                return
            chunks = []
            while True:
                message = await body.receive()
                if message["type"] != "http.request":
                    if not body.cut:  # the client left: what FastAPI answers (to nobody), counted
                        await _send_json(send, 400, _compact(error_json("HTTPException", PARSE_ERROR)), None)
                    return  # else refused (cap, deadline): answered
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            data = b"".join(chunks)
            files, query = read_files(data, boundary), read_query(scope.get("query_string", b""))
            if files is None or query is None or self.state.service is None:
                await self._to_app(scope, _replay(data, body.receive), body.send)
                return
            await self._classify(scope, send, files, query)
        finally:
            body.close()

    async def _classify(self, scope: Scope, send: Send, files: list[Upload], query: ClassifyQuery) -> None:
        service = self.state.service
        state = scope["state"]
        principal, ticket = state["principal"], state["ticket"]
        try:
            inputs = await classify_input(
                service.registry, self.state.settings, principal, ticket, files, query.top_k, query.tasks,
                query.logits,
            )  # fmt: skip
            payload = await answer(service.pipeline, inputs, principal, service.registry, as_json=True)
        except MemvitError as exc:  # as the app's handler for them (server/edge/errors.py)
            status = status_of(exc)
            if getattr(exc, "expected", False):
                log.warning("%d on POST %s: %s", status, PATH, exc)
            elif status >= 500:
                log.exception("unexpected %s on %s", type(exc).__name__, PATH, exc_info=exc)
            headers = exc.headers() if isinstance(exc, ServiceError) else None
            await _send_json(send, status, _compact(error_body(exc, status)), headers)
            return
        except Exception as exc:  # as the app's handler of last resort
            log.exception("unhandled error on %s", PATH, exc_info=exc)
            await _send_json(send, 500, _compact(error_json("InternalError", "internal error")), None)
            return
        await _send_json(send, 200, payload, None)

    async def _to_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[EDGE_DONE] = True
        await self.app(scope, receive, send)


def _replay(data: bytes, receive: Receive) -> Receive:
    """``receive`` for the app, which reads the body again: the body, then whatever comes next."""
    pending = [{"type": "http.request", "body": data, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _compact(body: dict) -> bytes:
    """An error body as ``JSONResponse`` renders it."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def _send_json(send: Send, status: int, body: bytes, headers: dict[str, str] | None) -> None:
    """A response as Starlette's ``Response`` sends it: its headers, then content-length and -type."""
    raw = [(key.lower().encode("latin-1"), value.encode("latin-1")) for key, value in (headers or {}).items()]
    raw += [(b"content-length", str(len(body)).encode()), _JSON]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
