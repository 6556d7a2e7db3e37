"""Liveness, readiness and Prometheus metrics. The probes are coroutines (a plain function would run
in a worker thread: a hop per probe); rendering the metrics, which takes a while, runs in one."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..http.deps import StateDep
from ..http.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
async def healthz() -> Health:
    return Health(status="alive")


@router.get(
    "/readyz",
    response_model=Health,
    summary="The model and the adapter store are loaded",
    responses={503: {"model": Health, "description": "still loading"}},
)
async def readyz(state: StateDep) -> Response:
    if state.service is None:
        body = Health(status="loading", detail="the model and the adapter store are still loading")
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "1"})
    registry, resident = state.service.registry, len(state.service.live.current)
    detail = f"{len(registry)} adapters registered, {resident} resident, v{registry.version}"
    if registry.catalog.damaged:  # still serving; changes refused until an operator repairs it
        detail += f"; {registry.catalog.damaged}"
    return JSONResponse(Health(status="ready", detail=detail).model_dump())


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
