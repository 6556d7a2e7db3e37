"""Request dependencies: the runtime, readiness, and the admin token check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from .errors import ForbiddenError, NotAuthenticatedError, NotReadyError, UnsupportedMediaTypeError
from .state import Runtime


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def ready_runtime(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Runtime:
    if not runtime.ready:
        raise NotReadyError("the model and the adapter store are still loading; retry shortly")
    return runtime


def require_admin(request: Request, runtime: Annotated[Runtime, Depends(ready_runtime)]) -> Runtime:
    """POST/DELETE /adapters: a valid ``Authorization: Bearer <token>`` when a token is configured."""
    token = runtime.settings.admin_token
    if token is None:
        return runtime
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise NotAuthenticatedError("this endpoint needs 'Authorization: Bearer <admin token>'")
    if not hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode()):
        raise ForbiddenError("the admin token is not valid")
    return runtime


def require_multipart(request: Request) -> None:
    """Uploads are multipart/form-data; say so (415) before anything tries to parse another body."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise UnsupportedMediaTypeError(
            f"expected a multipart/form-data upload, got {content_type or 'no content type'!r}"
        )


RuntimeDep = Annotated[Runtime, Depends(ready_runtime)]
AdminDep = Annotated[Runtime, Depends(require_admin)]
