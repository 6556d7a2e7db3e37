"""Every domain error and its HTTP status, in one place. Responses are ``{"error": {...}}`` JSON, built
by ``error_json`` (server/edge/send.py), the same function that builds the edge's own refusals.

Handlers never let an exception escape as a 500 with a traceback: a named error maps to its 4xx/503,
a request that fails validation to 422 with the field, anything else to a logged 500 that says only
"internal error".
"""

from __future__ import annotations

import logging
import math
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

from .edge.send import error_body, error_json
from .store import StoreUnavailableError

log = logging.getLogger(__name__)


class ServiceError(MemvitError):
    """An error of the HTTP layer. ``status`` is its HTTP status; ``headers()`` go on the response."""

    status = 400
    # An expected condition (not ready, overloaded): its message is shown even as a 5xx, and it is
    # logged as one line, not as an error with a traceback.
    expected = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def headers(self) -> dict[str, str] | None:
        return None


class EmptyImageError(ServiceError):
    status = 400


class NotAnImageError(ServiceError):
    status = 415


class UnsupportedMediaTypeError(ServiceError):
    status = 415


class BrokenImageError(ServiceError):
    status = 400


class ImageTooLargeError(ServiceError):
    status = 413


class TooManyImagesError(ServiceError):
    status = 413


class TooManyTasksError(ServiceError):
    """A request names more adapters than one request may ask for, or than this server can hold
    resident at once: a limit of the server's, like the number of images (413), named in the message."""

    status = 413


class TasksRequiredError(ServiceError):
    """No ``tasks`` filter while the registry holds more adapters than one request may compute."""

    status = 400


class UnknownTaskError(ServiceError):
    status = 422
    unknown: tuple[str, ...] = ()  # the tasks asked for that the adapter set lacks
    why: str = ""  # how that came about, when it is not the obvious


class NonFiniteOutputError(ServiceError):
    """A logit came out NaN or inf: answered as an error, never as null where the schema says number."""

    status = 500


class BundleTooLargeError(ServiceError):
    status = 413


class NotAuthenticatedError(ServiceError):
    status = 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class InvalidParameterError(ServiceError):
    """A parameter of the right shape with a value that means nothing (a day like 2026-13-01)."""

    status = 422


class NotRecordedError(ServiceError):
    """Something asked for is not kept on this server (usage, with the usage log off)."""

    status = 404


class ForbiddenError(ServiceError):
    status = 403


class AdminDisabledError(ForbiddenError):
    """No admin token is configured and anonymous management was not allowed (safe by default)."""


class CrossSiteRequestError(ForbiddenError):
    """A state-changing request sent by another site's page (its Origin or Sec-Fetch-Site says so)."""


class HostNotAllowedError(ServiceError):
    """The Host header names this server by a name it was not told to answer to (DNS rebinding)."""

    status = 400


class RequestTooLargeError(ServiceError):
    """The whole request body is over its route's cap (server/edge/guard.py), before any part is parsed."""

    status = 413


class RateLimitedError(ServiceError):
    """A key is past one of its limits (server/tenancy/limits.py): 429, and ``Retry-After`` says when its
    request could pass (whole seconds, at least 1, as the header allows no fraction)."""

    status = 429  # a 4xx: its message is shown; not logged per refusal (a limit refuses a lot)

    def __init__(self, message: str, *, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limit = limit  # which one: images_per_second or requests_in_flight

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class RetryLaterError(ServiceError):
    """A condition that passes (not ready, overloaded): 503 with its message and ``Retry-After``."""

    status = 503
    expected = True

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class NotReadyError(RetryLaterError):
    pass


class OverloadedError(RetryLaterError):
    pass


class DeviceMemoryError(RetryLaterError):
    """A pass did not fit in the device's memory, even for one image (server/inference/device_runner.py)."""


class ResidentSetFullError(RetryLaterError):
    """A cold load found every resident adapter pinned by queued requests: nothing could be evicted."""


class RequestTimeoutError(ServiceError):
    """The client did not send its request's headers (server/timeouts.py) or its body (server/edge/body.py)
    in time."""

    status = 408


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
