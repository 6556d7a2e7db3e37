"""Every named error of the service: what went wrong, with the HTTP status it is answered with.

Each ``ServiceError`` names its condition and carries the status a client sees (``status``) and any
headers (``headers()``, ``Retry-After`` say); the engine's and the bundle format's own errors come
from memvit.memory_core and memvit.adapters. Nothing here knows HTTP's machinery: the mapping of
every error to its response (the engine's errors' statuses, the JSON body, the FastAPI handlers) is
server/edge/errors.py, in one place. This module imports nothing of memvit.server, so every layer may
raise these.
"""

from __future__ import annotations

import math

from memvit.memory_core import MemvitError


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
    """The client did not send its request's headers (server/http/timeouts.py) or its body
    (server/edge/body.py) in time."""

    status = 408
