"""Request dependencies: narrow views of the service (503 until it is ready), and validated input.

Who may call a route, and how large and slow its body may be, are the edge's (server/edge/): they
are settled before a route's dependencies run. What is here reads the request the edge let through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, File, Query, Request, UploadFile

from memory_core import LiveAdapters

from .errors import NotReadyError, TooManyImagesError, UnsupportedMediaTypeError
from .pipeline import ClassifyPipeline
from .registry import AdapterRegistry
from .settings import Settings
from .state import AppState, Service
from .tasks import check_tasks, parse_tasks


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


def get_live(service: Annotated[Service, Depends(get_service)]) -> LiveAdapters:
    return service.live


def get_registry(service: Annotated[Service, Depends(get_service)]) -> AdapterRegistry:
    return service.registry


def get_pipeline(service: Annotated[Service, Depends(get_service)]) -> ClassifyPipeline:
    return service.pipeline


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
LiveDep = Annotated[LiveAdapters, Depends(get_live)]
RegistryDep = Annotated[AdapterRegistry, Depends(get_registry)]
PipelineDep = Annotated[ClassifyPipeline, Depends(get_pipeline)]


@dataclass(frozen=True)
class ClassifyInput:
    """A /classify request, checked: at most the allowed number of images, and ``tasks`` parsed and
    each one registered when the request arrived (None: every task)."""

    images: list[UploadFile]
    tasks: list[str] | None
    top_k: int
    logits: bool


async def classify_input(
    registry: RegistryDep,
    settings: SettingsDep,
    image: Annotated[list[UploadFile], File(description="one or more images (repeat the field for a batch)")],
    top_k: Annotated[int, Query(ge=1, le=1000, description="labels per task")] = 5,
    tasks: Annotated[
        list[str] | None, Query(description="tasks to return (repeat or comma-separate); default: all")
    ] = None,
    logits: Annotated[bool, Query(description="also return raw logits")] = False,
) -> ClassifyInput:
    """Runs only once every parameter is valid (FastAPI answers 422 for those first); then the image
    count (413), then the tasks against the registry (400, 413, 422), before anything is decoded."""
    if len(image) > settings.max_images_per_request:
        raise TooManyImagesError(
            f"{len(image)} images in one request; the limit is {settings.max_images_per_request}",
            field="image",
        )
    wanted = parse_tasks(tasks)
    await check_tasks(wanted, registry)  # fail fast, before decoding anything
    return ClassifyInput(image, wanted, top_k, logits)


ClassifyInputDep = Annotated[ClassifyInput, Depends(classify_input)]
