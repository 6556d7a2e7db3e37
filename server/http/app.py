"""The FastAPI application: built by ``create_app(settings)``, loaded in the background.

Start-up order: the server answers at once (``/healthz`` 200, ``/readyz`` 503); a background task
loads the base model and the registry (the store's index and the journal since: no bundle is read),
then starts the batcher and the store poller and flips ready. If loading fails, the error is logged
in one line and the process stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI

from ..edge.errors import install_error_handlers
from ..edge.guard import Edge, GuardMiddleware
from ..edge.routes import missing_routes, route_table
from ..oip.errors import ProtocolErrorShape
from ..routers import adapters, classify, health, oip, ui, usage
from ..routers.classify_raw import MemvitAPI, RawClassify
from ..settings import Settings, get_settings
from ..telemetry.metrics import Metrics, MetricsMiddleware, RequestMeter
from ..telemetry.task_labels import TaskLabels
from ..tenancy.limits import Limiter
from .openapi import customise as customise_openapi
from .service import build_engine, preflight, resolve_device, start_service, stop_service
from .state import AppState

log = logging.getLogger("memvit.server")
__all__ = ["build_engine", "create_app", "preflight", "resolve_device"]


def create_app(
    settings: Settings | None = None,
    *,
    metrics: Metrics | None = None,
    start: Callable[[AppState], Awaitable[None]] | None = None,
    limiter: Limiter | None = None,
    raw_classify: bool = True,
) -> FastAPI:
    """The app. The keywords are for a front end of several processes (server/frontend/): ``metrics``
    that render one view of every process, ``start`` that builds ``state.service`` (default: load the
    model here), ``limiter`` that keeps the keys' limits (default: here). ``raw_classify=False``
    serves ``POST /classify`` through FastAPI alone (the tests compare the two)."""
    settings = settings or get_settings()

    labels = TaskLabels(settings.metrics_tasks, settings.metrics_top_tasks)
    state = AppState(settings=settings, metrics=metrics if metrics is not None else Metrics(labels))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.anonymous_admin:
            log.warning(
                "!!! no MEMVIT_ADMIN_TOKEN or MEMVIT_API_KEYS_FILE, and anonymous admin is allowed: anyone "
                "who can reach this port can add and delete adapters. Set a token for any deployment beyond "
                "a laptop. !!!"
            )
        elif settings.admin_token is None and settings.api_keys_file is None:
            log.warning(
                "MEMVIT_ADMIN_TOKEN is not set: POST/DELETE /adapters answer 403 (set a token or a keys "
                "file, or MEMVIT_ALLOW_ANONYMOUS_ADMIN=true to leave them open)"
            )
        state.loader = asyncio.create_task((start or start_service)(state), name="loader")
        state.tasks.append(state.loader)
        yield
        await stop_service(state)

    edge = Edge(settings, state.metrics, limiter)  # one for the guard and the raw /classify
    app = MemvitAPI(
        title="memvit",
        summary="One frozen ViT plus learnable-memory adapters, served as one fused forward pass.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.memvit = state
    # The guard (access, body cap and deadline per route) runs before the router parses any body;
    # inside the metrics middleware, so its refusals are counted as what the client got.
    app.add_middleware(GuardMiddleware, settings=settings, edge=edge)
    # Outside the guard, so its refusals under /v2 get the Open Inference Protocol's error shape too.
    app.add_middleware(ProtocolErrorShape)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics, server_timing=settings.server_timing)
    if raw_classify:  # POST /classify before the stack, with its code (routers/classify_raw.py)
        meter = RequestMeter(state.metrics, settings.server_timing)
        app.outer = lambda stack, added: RawClassify(stack, state, edge, meter, added)
        app.own_middleware = len(app.user_middleware)
    install_error_handlers(app)
    customise_openapi(app, settings)
    app.include_router(classify.router)
    app.include_router(adapters.router)
    app.include_router(health.router)
    app.include_router(oip.router)  # the Open Inference Protocol (KServe v2 / Triton HTTP)
    app.include_router(usage.router)  # usage per key, read back from the store
    app.include_router(ui.router)  # the page at /: a client of the routes above
    # A route without a row in the guard's table would get the fallback (public, uncapped): refuse to
    # build such an app rather than serve it.
    if missing := missing_routes(app, route_table(settings)):
        raise RuntimeError(f"routes missing from the route table (server/edge/routes.py): {missing}")
    return app
