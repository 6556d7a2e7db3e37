"""The Open Inference Protocol (KServe v2 / Triton HTTP) beside the JSON API, on the same fused pass,
batcher, decoder, guard and caps. The models it shows are described in server/oip/models.py; the wire
format (JSON and binary tensor data, the classification extension) is server/oip/protocol.py.
"""

from __future__ import annotations

from collections.abc import Awaitable

import numpy as np
import torch
from fastapi import APIRouter, Request, Response

from ..edge.principal import Principal
from ..errors import ImageTooLargeError, TooManyImagesError
from ..http.deps import PrincipalDep, SettingsDep, StateDep, TicketDep, charge, resolve_tasks, service_of
from ..http.openapi import protocol_errors
from ..http.pipeline import Ask, Tenant
from ..http.state import Service
from ..oip import models
from ..oip.protocol import (
    HEADER_LENGTH,
    InferRequest,
    OutputTensor,
    ProtocolError,
    classification,
    encode_infer_response,
    parse_infer_request,
)
from ..telemetry.stages import current_stages

router = APIRouter(prefix="/v2", tags=["open inference protocol"])
NO_BODY: dict[int | str, dict] = {200: {"description": "an empty body: the status says it", "content": {}}}
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]


@router.get("", summary="Server metadata")
async def server_metadata(request: Request) -> dict:
    return {"name": "memvit", "version": request.app.version, "extensions": EXTENSIONS}


@router.get("/health/live", response_class=Response, responses=NO_BODY, summary="200 while the process runs")
async def live() -> Response:
    return Response(status_code=200)


@router.get(
    "/health/ready",
    response_class=Response,
    responses={**NO_BODY, **protocol_errors(503)},
    summary="200 once the model and the adapter store are loaded, else 503",
)
async def ready(state: StateDep) -> Response:
    service_of(state)  # raises NotReadyError (503) while loading
    return Response(status_code=200)


@router.post(
    "/repository/index",
    responses=protocol_errors(401, 403, 503),
    summary="The models: the fused base model and one per adapter",
)
def repository_index(state: StateDep, principal: PrincipalDep) -> list[dict]:
    service = service_of(state)
    names = models.known_models(service.registry, principal)
    return [{"name": name, "version": "1", "state": "READY"} for name in names]


@router.get(
    "/models/{model}",
    responses=protocol_errors(401, 403, 404, 422, 503),
    summary="A model's inputs and outputs",
)
def model_metadata(model: str, state: StateDep, principal: PrincipalDep) -> dict:
    service = service_of(state)
    return models.metadata(model, service.engine, service.registry, principal)


@router.get(
    "/models/{model}/ready",
    response_class=Response,
    responses={**NO_BODY, **protocol_errors(401, 403, 404, 422, 503)},
    summary="200 when the model can answer",
)
def model_ready(model: str, state: StateDep, principal: PrincipalDep) -> Response:
    service = service_of(state)
    models.tasks_of(model, service.registry, principal)  # 404 for a model this caller cannot see
    return Response(status_code=200)


@router.post(
    "/models/{model}/infer",
    responses=protocol_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 503),
    summary="Inference: encoded images (BYTES) or pixels (FP32)",
)
async def infer(
    model: str,
    request: Request,
    state: StateDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    ticket: TicketDep,
) -> Response:
    service = service_of(state)
    header = request.headers.get(HEADER_LENGTH)
    try:
        header_length = None if header is None else int(header)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {header!r}") from None
    parsed = parse_infer_request(await request.body(), header_length)
    stages = current_stages()
    if stages is not None:
        stages.received()
    count = _count(parsed, settings.max_images_per_request)  # 413 over the server's cap, first
    tenant = await charge(ticket, count)  # then the key's limits (413, 429), before any other work
    tasks, names = await _outputs(model, parsed, service, principal)
    images = _images(parsed, service, settings, tenant)
    # The logits of every task (the classification extension's top k is read off them here).
    answer = await service.pipeline.run(Ask(count, tasks, tenant, top_k=0, logits=True), images)
    position = {task: t for t, task in enumerate(answer.tasks)}
    names = names if names is not None else {task: task for task in answer.tasks}
    engine, registry = service.engine, service.registry
    outputs, binary = [], set()
    for task, name in names.items():
        asked = next((o for o in parsed.outputs if o.name == name), None)
        array = answer.task_logits(position[task])
        if asked is not None and asked.class_count > 0:
            labels = models.labels_of(task, engine, registry)
            outputs.append(OutputTensor(name, "BYTES", classification(array, labels, asked.class_count)))
        else:
            outputs.append(OutputTensor(name, "FP32", array))
        if asked.binary if asked is not None else parsed.binary_outputs:
            binary.add(name)
    body, headers = encode_infer_response(model, parsed, outputs, binary)
    return Response(body, headers=headers)


async def _outputs(
    model: str, parsed: InferRequest, service: Service, principal: Principal
) -> tuple[list[str] | None, dict[str, str] | None]:
    """The tasks to compute (None: every task) and, per task, the output name it answers under."""
    registry = service.registry
    fixed = models.tasks_of(model, registry, principal)
    asked = [o.name for o in parsed.outputs]
    if fixed is not None:  # an adapter's own model: one output, "logits"
        if any(name != models.ADAPTER_OUTPUT for name in asked):
            raise ProtocolError(f"model {model!r} has one output, {models.ADAPTER_OUTPUT!r}")
        tasks = await resolve_tasks(fixed, principal, registry)
        return tasks, {fixed[0]: models.ADAPTER_OUTPUT}
    if len(set(asked)) != len(asked):
        raise ProtocolError("an output is asked for twice")
    tasks = await resolve_tasks(asked or None, principal, registry)  # outputs route the pass
    # None: every task the pass computes (the registry's adapters, less any deleted meanwhile).
    return tasks, None if tasks is None else {task: task for task in tasks}


def _count(parsed: InferRequest, limit: int) -> int:
    """The number of images in the request's one input (checked: 400 without exactly one, 413 over
    ``limit``), before anything is done with them."""
    given = set(parsed.inputs)
    if len(given) != 1 or not given <= {models.IMAGE, models.PIXELS}:
        raise ProtocolError(
            f"give exactly one input, {models.IMAGE!r} (BYTES: encoded images) or {models.PIXELS!r} "
            f"(FP32: preprocessed images); got {sorted(given)}"
        )
    tensor = parsed.inputs[models.IMAGE] if models.IMAGE in given else parsed.inputs[models.PIXELS]
    count = tensor.size if models.IMAGE in given else (tensor.shape[0] if tensor.ndim == 4 else 1)
    if count == 0:
        raise ProtocolError("the request holds no images")
    if count > limit:
        raise TooManyImagesError(f"{count} images in one request; the limit is {limit}")
    return int(count)


def _images(
    parsed: InferRequest, service: Service, settings: SettingsDep, tenant: Tenant
) -> Awaitable[torch.Tensor | list]:
    """The request's one input (counted by ``_count``) -> an awaitable of (n, C, H, W)."""
    if models.IMAGE in parsed.inputs:
        blobs = list(parsed.inputs[models.IMAGE].reshape(-1))
        for i, blob in enumerate(blobs):
            if len(blob) > settings.max_image_bytes:
                raise ImageTooLargeError(f"image {i}: over the {settings.max_image_bytes}-byte limit")
        names = [f"image-{i}" for i in range(len(blobs))]
        return service.pipeline.decode(blobs, names, tenant)
    pixels = parsed.inputs[models.PIXELS]
    expected = (service.engine.base.patch_embed.proj.in_channels, *service.engine.spec.img_size)
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != expected:
        raise ProtocolError(
            f"{models.PIXELS} must have shape [-1, {', '.join(map(str, expected))}], got {list(pixels.shape)}"
        )
    if not np.isfinite(pixels).all():
        raise ProtocolError(f"{models.PIXELS} holds non-finite values")

    async def ready() -> torch.Tensor:
        return torch.from_numpy(pixels)

    return ready()
