"""Who may call a route: the rule behind each ``Access`` of the route table, on the headers alone.

The guard runs it before a byte of the body is read (FastAPI parses a multipart form before a route's
dependencies run, so a check in the route would come after the upload was spooled to disk). It is
the only place a request's credentials are checked.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from ..errors import AdminDisabledError, ForbiddenError, NotAuthenticatedError
from ..settings import Settings
from .routes import Access, Route


def check_access(route: Route, settings: Settings, headers: Headers) -> None:
    """Raises the ``ServiceError`` (401/403) that refuses this request, if one does."""
    if route.access is Access.ADMIN:
        check_admin(settings, headers.get("authorization"))


def check_admin(settings: Settings, authorization: str | None) -> None:
    """The admin rule, given the request's ``Authorization`` header.

    A token configured: ``Bearer <token>`` (compared in constant time) or 401/403. No token: 403,
    unless ``allow_anonymous_admin`` opts out.
    """
    token = settings.admin_token
    if token is None:
        if settings.allow_anonymous_admin:
            return
        raise AdminDisabledError(
            "adapter management is disabled: no admin token is configured. Set MEMVIT_ADMIN_TOKEN and "
            "send 'Authorization: Bearer <token>', or set MEMVIT_ALLOW_ANONYMOUS_ADMIN=true to let "
            "anyone who can reach this port add and delete adapters"
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise NotAuthenticatedError("this endpoint needs 'Authorization: Bearer <admin token>'")
    if not hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode()):
        raise ForbiddenError("the admin token is not valid")
