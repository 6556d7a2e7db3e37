"""POST /classify: one or several images, every task (or a chosen few) from one fused pass.

A key's request names its tasks (``deps.classify_input``), so its answer holds only those; a late
"unknown task" refusal (an adapter deleted while the request waited) names only the key's adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..errors import UnknownTaskError
from ..http.deps import ClassifyInputDep, PipelineDep, PrincipalDep, RegistryDep, require_multipart
from ..http.openapi import errors
from ..http.schemas import ClassifyResponse
from ..inference.tasks import unknown_tasks_error

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
    try:
        answer = await pipeline(
            inputs.images, tasks=inputs.tasks, top_k=inputs.top_k, logits=inputs.logits, tenant=inputs.tenant
        )
    except UnknownTaskError as exc:  # removed while the request waited: named by the batch's whole set
        if principal.sees_all:
            raise
        known = registry.all_names()
        raise unknown_tasks_error(list(exc.unknown), known, len(known), exc.why, principal.may_read) from None
    return answer
