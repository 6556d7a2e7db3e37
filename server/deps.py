"""Request dependencies: narrow views of the service (503 until it is ready) and the admin check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from memory_core import MemoryViT

from .adapter_service import AdapterService
from .errors import (
    AdminDisabledError,
    ForbiddenError,
    NotAuthenticatedError,
    NotReadyError,
    UnsupportedMediaTypeError,
)
from .pipeline import ClassifyPipeline
from .settings import Settings
from .state import AppState, Service


def get_state(request: Request) -> AppState:
    return request.app.state.memvit


def get_settings(state: Annotated[AppState, Depends(get_state)]) -> Settings:
    return state.settings


def get_service(state: Annotated[AppState, Depends(get_state)]) -> Service:
    if state.service is None:
        raise NotReadyError("the model and the adapter store are still loading; retry shortly")
    return state.service


def check_admin(settings: Settings, authorization: str | None) -> None:
    """The one rule for POST/DELETE /adapters, given the request's ``Authorization`` header.

    A token configured: ``Bearer <token>`` (compared in constant time) or 401/403. No token: 403,
    unless ``allow_anonymous_admin`` opts out. Called by the edge middleware before any body is
    read, and by ``require_admin`` for apps served without it.
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


def require_admin(request: Request, settings: Annotated[Settings, Depends(get_settings)]) -> None:
    """POST/DELETE /adapters: ``check_admin`` on the request's ``Authorization`` header."""
    check_admin(settings, request.headers.get("authorization"))


def require_multipart(request: Request) -> None:
    """Uploads are multipart/form-data; say so (415) before anything tries to parse another body."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise UnsupportedMediaTypeError(
            f"expected a multipart/form-data upload, got {content_type or 'no content type'!r}"
        )


def get_engine(service: Annotated[Service, Depends(get_service)]) -> MemoryViT:
    return service.engine


def get_adapters(service: Annotated[Service, Depends(get_service)]) -> AdapterService:
    return service.adapters


def get_pipeline(service: Annotated[Service, Depends(get_service)]) -> ClassifyPipeline:
    return service.pipeline


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[MemoryViT, Depends(get_engine)]
AdaptersDep = Annotated[AdapterService, Depends(get_adapters)]
PipelineDep = Annotated[ClassifyPipeline, Depends(get_pipeline)]
