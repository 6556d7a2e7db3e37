"""POST /classify: one or several images, every task (or a chosen few) from one fused pass."""

from __future__ import annotations

import asyncio
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, File, Query, UploadFile

from memory_core import BASE_TASK, AdapterSet

from ..batching import BatchResult
from ..deps import RuntimeDep, require_multipart
from ..errors import ImageTooLargeError, TooManyImagesError, UnknownTaskError
from ..schemas import AdapterSetInfo, ClassifyResponse, ErrorResponse, ImageResult, Prediction, TaskResult
from ..state import Runtime

router = APIRouter(tags=["classify"])
ERRORS = {code: {"model": ErrorResponse} for code in (400, 413, 415, 422, 503)}


@router.post("/classify", response_model=ClassifyResponse, responses=ERRORS, summary="Classify images")
async def classify(
    _: Annotated[None, Depends(require_multipart)],
    runtime: RuntimeDep,
    image: Annotated[list[UploadFile], File(description="one or more images (repeat the field for a batch)")],
    top_k: Annotated[int, Query(ge=1, le=1000, description="labels per task")] = 5,
    tasks: Annotated[
        list[str] | None, Query(description="tasks to return (repeat or comma-separate); default: all")
    ] = None,
    logits: Annotated[bool, Query(description="also return raw logits")] = False,
) -> ClassifyResponse:
    settings = runtime.settings
    if len(image) > settings.max_images_per_request:
        raise TooManyImagesError(
            f"{len(image)} images in one request; the limit is {settings.max_images_per_request}",
            field="image",
        )
    wanted = _parse_tasks(tasks)
    _check_tasks(wanted, runtime.engine.adapters)  # fail fast, before decoding anything
    loop = asyncio.get_running_loop()
    names, pixels = [], []
    with runtime.batcher.expecting(len(image)):  # a batch forming now may wait for these images
        for i, upload in enumerate(image):
            name = upload.filename or f"image-{i}"
            data = await _read_capped(upload, settings.max_image_bytes, name)
            names.append(name)
            pixels.append(loop.run_in_executor(runtime.decode_pool, runtime.decoder, data, name))
        batch = torch.stack(await asyncio.gather(*pixels))
    # No await between leaving `expecting` and `submit` queueing the job: the gatherer sees one or
    # the other, never neither.
    result = await runtime.batcher.submit(batch)
    _check_tasks(wanted, result.adapter_set)  # an adapter may have been removed meanwhile
    return _response(runtime, result, names, wanted, top_k, logits)


async def _read_capped(upload: UploadFile, limit: int, name: str) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise ImageTooLargeError(f"{name}: over the {limit}-byte upload limit", field=name)
    return data


def _parse_tasks(tasks: list[str] | None) -> list[str] | None:
    if not tasks:
        return None
    return [t.strip() for item in tasks for t in item.split(",") if t.strip()] or None


def _check_tasks(wanted: list[str] | None, adapter_set: AdapterSet) -> None:
    if wanted is None:
        return
    unknown = [t for t in wanted if t != BASE_TASK and t not in adapter_set]
    if unknown:
        known = [BASE_TASK, *adapter_set.names]
        raise UnknownTaskError(f"unknown task(s) {unknown}; this server has {known}", field="tasks")


def _response(
    runtime: Runtime,
    result: BatchResult,
    names: list[str],
    wanted: list[str] | None,
    top_k: int,
    logits: bool,
) -> ClassifyResponse:
    adapter_set = result.adapter_set
    engine = runtime.engine
    task_logits = {BASE_TASK: result.base, **result.adapters}
    labels = {BASE_TASK: engine.labels, **{a.name: a.weights.labels for a in adapter_set}}
    order = wanted or list(task_logits)
    per_task = {}
    for task in order:
        values = task_logits[task]
        probs = values.softmax(-1)
        k = min(top_k, values.shape[-1])
        top = probs.topk(k, dim=-1)
        per_task[task] = (values, top, labels[task])
    results = []
    for i, name in enumerate(names):
        tasks = {}
        for task, (values, top, task_labels) in per_task.items():
            predictions = [
                Prediction(label=_label(task_labels, int(j)), index=int(j), probability=float(p))
                for p, j in zip(top.values[i], top.indices[i], strict=True)
            ]
            tasks[task] = TaskResult(predictions=predictions, logits=values[i].tolist() if logits else None)
        results.append(ImageResult(image=name, tasks=tasks))
    info = AdapterSetInfo(version=adapter_set.version, adapters=list(adapter_set.names))
    return ClassifyResponse(adapter_set=info, results=results)


def _label(labels: tuple[str, ...] | None, index: int) -> str:
    return labels[index] if labels is not None and index < len(labels) else f"class_{index}"
