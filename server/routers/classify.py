"""POST /classify: one or several images, every task (or a chosen few) from one fused pass."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Query, UploadFile

from ..deps import PipelineDep, require_multipart
from ..openapi import errors
from ..schemas import ClassifyResponse

router = APIRouter(tags=["classify"])


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=errors(400, 408, 413, 415, 422, 503),
    summary="Classify images",
    dependencies=[Depends(require_multipart)],
)
async def classify(
    pipeline: PipelineDep,
    image: Annotated[list[UploadFile], File(description="one or more images (repeat the field for a batch)")],
    top_k: Annotated[int, Query(ge=1, le=1000, description="labels per task")] = 5,
    tasks: Annotated[
        list[str] | None, Query(description="tasks to return (repeat or comma-separate); default: all")
    ] = None,
    logits: Annotated[bool, Query(description="also return raw logits")] = False,
) -> ClassifyResponse:
    return await pipeline(image, tasks=tasks, top_k=top_k, logits=logits)
