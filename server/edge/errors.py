"""Every error's HTTP response, in one place: its status, its ``{"error": {...}}`` body, the handlers.

The named errors live in server/errors.py (each ``ServiceError`` carries its status); here the
engine's and the bundle format's errors get theirs (``DOMAIN_STATUS``), ``status_of`` answers for
any exception, and ``install_error_handlers`` puts the FastAPI handlers on an app. Bodies are built
by ``error_json`` (server/edge/send.py), the same function that builds the edge's own refusals.

Handlers never let an exception escape as a 500 with a traceback: a named error maps to its 4xx/503,
a request that fails validation to 422 with the field, anything else to a logged 500 that says only
"internal error".
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from memvit.adapters import BaseMismatchError, BundleError
from memvit.memory_core import (
    AdapterInUseError,
    DuplicateAdapterError,
    InputError,
    InvalidAdapterError,
    MemvitError,
    MissingParentError,
    UnknownAdapterError,
)

from ..errors import ServiceError
from ..store import StoreUnavailableError
from .send import error_body, error_json

log = logging.getLogger("memvit.server.errors")  # the name the handlers have always logged under


# Engine and bundle errors, most specific first.
DOMAIN_STATUS: list[tuple[type[Exception], int]] = [
    (DuplicateAdapterError, 409),
    (AdapterInUseError, 409),
    (MissingParentError, 409),
    (UnknownAdapterError, 404),
    (BaseMismatchError, 422),
    (BundleError, 422),
    (InvalidAdapterError, 422),
    (InputError, 422),
    (StoreUnavailableError, 503),
]


def status_of(exc: Exception) -> int:
    if isinstance(exc, ServiceError):
        return exc.status
    for kind, status in DOMAIN_STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def _allowed_methods(request: Request) -> list[str]:
    def walk(routes: list) -> Iterator[BaseRoute]:
        for route in routes:
            included = getattr(route, "original_router", None)  # FastAPI's wrapper of an included router
            yield from walk(included.routes) if included is not None else (route,)

    methods: set[str] = set()
    for route in walk(request.app.router.routes):
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MemvitError)
    async def _domain(request: Request, exc: MemvitError) -> JSONResponse:
        status = status_of(exc)
        if getattr(exc, "expected", False):
            log.warning("%d on %s %s: %s", status, request.method, request.url.path, exc)
        elif status >= 500:
            log.exception("unexpected %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
        headers = exc.headers() if isinstance(exc, ServiceError) else None
        return JSONResponse(error_body(exc, status), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err.get("loc", ()) if part not in ("body", "query"))
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        field = next((str(e["loc"][-1]) for e in exc.errors() if e.get("loc")), None)
        return JSONResponse(error_json("RequestValidationError", "; ".join(problems), field), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_json("HTTPException", str(exc.detail))
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # One path can be served by several routes (GET and DELETE /adapters/{name}); Starlette
            # names only the first one's methods. Allow lists every method the path supports.
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return JSONResponse(body, status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_json("InternalError", "internal error"), status_code=500)
