"""Request dependencies: narrow views of the service (503 until it is ready), and validated input.

Every dependency is a coroutine, even those that only look something up: FastAPI runs a plain
function dependency in a worker thread, a thread hop per dependency per request.

Who may call a route, and how large and slow its body may be, are the edge's (server/edge/): they
are settled before a route's dependencies run. What is here reads the request the edge let through,
and the principal it settled on (``PrincipalDep``), by which the routes filter what a key may see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, File, Query, Request, UploadFile

from memvit.memory_core import BASE_TASK, LiveAdapters

from ..edge.access import name_refused
from ..edge.principal import Principal
from ..errors import NotReadyError, TooManyImagesError, UnsupportedMediaTypeError
from ..inference.tasks import check_tasks, parse_tasks
from ..registry import AdapterRegistry
from ..settings import Settings
from ..tenancy.audit import AuditEntry
from ..tenancy.limits import Ticket
from .pipeline import ClassifyPipeline, Tenant
from .state import AppState, Service


async def get_state(request: Request) -> AppState:
    return request.app.state.memvit


async def get_settings(state: Annotated[AppState, Depends(get_state)]) -> Settings:
    return state.settings


def service_of(state: AppState) -> Service:
    """The loaded service, or 503 while the model and the store load."""
    if state.service is None:
        raise NotReadyError("the model and the adapter store are still loading; retry shortly")
    return state.service


async def get_service(state: Annotated[AppState, Depends(get_state)]) -> Service:
    return service_of(state)


async def require_multipart(request: Request) -> None:
    """Uploads are multipart/form-data; say so (415) before anything tries to parse another body."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise UnsupportedMediaTypeError(
            f"expected a multipart/form-data upload, got {content_type or 'no content type'!r}"
        )


async def get_principal(request: Request) -> Principal:
    """Who is calling, as the guard resolved it (server/edge/principal.py)."""
    principal = getattr(request.state, "principal", None)
    if principal is None:  # never served without the guard: fail closed, not open
        raise RuntimeError("no principal on the request: is GuardMiddleware installed?")
    return principal


async def get_ticket(request: Request) -> Ticket:
    """The guard's admission of this request to a metered route (server/tenancy/limits.py)."""
    ticket = getattr(request.state, "ticket", None)
    if ticket is None:  # a metered route served without the guard: fail closed
        raise RuntimeError("no ticket on the request: is GuardMiddleware installed and the route metered?")
    return ticket


async def charge(ticket: Ticket, images: int) -> Tenant:
    """Counts a request's ``images`` against its key's limits (413/429); the tenant its work is
    queued and counted as."""
    await ticket.charge_async(images)
    return Tenant(ticket.tenant, ticket.weight)


async def get_audit(request: Request) -> AuditEntry:
    """The audit entry the guard opened for this state-changing request (server/tenancy/audit.py)."""
    return request.state.audit


async def get_live(service: Annotated[Service, Depends(get_service)]) -> LiveAdapters:
    return service.live


async def get_registry(service: Annotated[Service, Depends(get_service)]) -> AdapterRegistry:
    return service.registry


async def get_pipeline(service: Annotated[Service, Depends(get_service)]) -> ClassifyPipeline:
    return service.pipeline


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
LiveDep = Annotated[LiveAdapters, Depends(get_live)]
RegistryDep = Annotated[AdapterRegistry, Depends(get_registry)]
PipelineDep = Annotated[ClassifyPipeline, Depends(get_pipeline)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
AuditDep = Annotated[AuditEntry, Depends(get_audit)]
TicketDep = Annotated[Ticket, Depends(get_ticket)]


@dataclass(frozen=True)
class ClassifyInput:
    """A /classify request, checked: at most the allowed number of images, and ``tasks`` parsed and
    each one registered when the request arrived (None: every task). For a key, ``tasks`` is never None:
    no filter means base and the adapters the key may read, so nothing else is computed."""

    images: list[UploadFile]
    tasks: list[str] | None
    top_k: int
    logits: bool
    tenant: Tenant  # whose request: queued by its weight, counted as its usage


async def classify_input(
    registry: RegistryDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    ticket: TicketDep,
    image: Annotated[list[UploadFile], File(description="one or more images (repeat the field for a batch)")],
    top_k: Annotated[int, Query(ge=1, le=1000, description="labels per task")] = 5,
    tasks: Annotated[
        list[str] | None, Query(description="tasks to return (repeat or comma-separate); default: all")
    ] = None,
    logits: Annotated[bool, Query(description="also return raw logits")] = False,
) -> ClassifyInput:
    """Runs only once every parameter is valid (FastAPI answers 422 for those first); then the image
    count (413), the key's limits on it (413, 429), then the tasks against the key (403, before
    whether they exist), then against the registry (400, 413, 422), before anything is decoded."""
    if len(image) > settings.max_images_per_request:
        raise TooManyImagesError(
            f"{len(image)} images in one request; the limit is {settings.max_images_per_request}",
            field="image",
        )
    tenant = await charge(ticket, len(image))
    wanted = await resolve_tasks(parse_tasks(tasks), principal, registry)  # before decoding anything
    return ClassifyInput(image, wanted, top_k, logits, tenant)


async def resolve_tasks(
    wanted: list[str] | None, principal: Principal, registry: AdapterRegistry
) -> list[str] | None:
    """The tasks a request will compute: ``wanted`` checked against the caller (403, before whether
    they exist) and the registry (400, 413, 422); for a key, no filter means base and the adapters it
    may read. None: every task. Shared by /classify and the Open Inference Protocol's infer."""
    if not principal.sees_all:
        if wanted is None:
            wanted = [BASE_TASK, *principal.visible(registry.all_names())]
        elif refused := [t for t in wanted if not principal.may_read(t)]:
            error = name_refused(principal, refused, "read")
            error.field = "tasks"
            raise error
    await check_tasks(wanted, registry, None if principal.sees_all else principal.may_read)
    return wanted


ClassifyInputDep = Annotated[ClassifyInput, Depends(classify_input)]
