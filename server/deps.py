"""Request dependencies: narrow views of the service (503 until it is ready).

Who may call a route, and how large and slow its body may be, are the edge's (server/edge/): they
are settled before a route's dependencies run. What is here reads the request the edge let through.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from memory_core import MemoryViT

from .adapter_service import AdapterService
from .errors import NotReadyError, UnsupportedMediaTypeError
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
