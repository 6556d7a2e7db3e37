"""POST /classify: one or several images, every task (or a chosen few) from one fused pass."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..deps import ClassifyInputDep, PipelineDep, require_multipart
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
async def classify(pipeline: PipelineDep, inputs: ClassifyInputDep) -> ClassifyResponse:
    return await pipeline(inputs.images, tasks=inputs.tasks, top_k=inputs.top_k, logits=inputs.logits)
