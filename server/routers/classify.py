"""POST /classify: one or several images, every task (or a chosen few) from one fused pass.

A key's request names its tasks (``deps.classify_input``), so its answer holds only those; a late
"unknown task" refusal (an adapter deleted while the request waited) names only the key's adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..edge.principal import Principal
from ..errors import UnknownTaskError
from ..http.deps import (
    ClassifyInput,
    ClassifyInputDep,
    PipelineDep,
    PrincipalDep,
    RegistryDep,
    require_multipart,
)
from ..http.openapi import errors
from ..http.pipeline import ClassifyPipeline
from ..http.schemas import ClassifyResponse
from ..inference.tasks import unknown_tasks_error
from ..registry import AdapterRegistry

router = APIRouter(tags=["classify"])


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=errors(400, 401, 403, 408, 413, 415, 422, 429, 503),
    summary="Classify images",
    dependencies=[Depends(require_multipart)],
)
async def classify(
    pipeline: PipelineDep, inputs: ClassifyInputDep, principal: PrincipalDep, registry: RegistryDep
) -> ClassifyResponse:
    return await answer(pipeline, inputs, principal, registry)


async def answer(
    pipeline: ClassifyPipeline,
    inputs: ClassifyInput,
    principal: Principal,
    registry: AdapterRegistry,
    *,
    as_json: bool = False,
) -> ClassifyResponse | bytes:
    """The route's work; ``as_json``: its response's JSON as FastAPI sends it (the raw route's)."""
    try:
        return await pipeline(
            inputs.images,
            tasks=inputs.tasks,
            top_k=inputs.top_k,
            logits=inputs.logits,
            tenant=inputs.tenant,
            as_json=as_json,
        )
    except UnknownTaskError as exc:  # removed while the request waited: named by the batch's whole set
        if principal.sees_all:
            raise
        known = registry.all_names()
        raise unknown_tasks_error(list(exc.unknown), known, len(known), exc.why, principal.may_read) from None
