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
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI

from memvit.memory_core import LiveAdapters, MemoryViT

from .batching import DynamicBatcher
from .device_decode import DeviceDecoder
from .edge.guard import Edge, GuardMiddleware
from .edge.principal import check_credentials
from .edge.routes import missing_routes, route_table
from .errors import install_error_handlers
from .fair_queue import FairPool
from .images import ImageDecoder
from .limits import Limiter
from .metrics import Metrics, MetricsMiddleware, RequestMeter
from .oip.errors import ProtocolErrorShape
from .openapi import customise as customise_openapi
from .pipeline import ClassifyPipeline
from .registry import AdapterRegistry
from .routers import adapters, classify, health, oip, ui, usage
from .routers.classify_raw import MemvitAPI, RawClassify
from .settings import Settings, get_settings
from .state import AppState, Service
from .store import StoreUnavailableError, open_store
from .task_labels import TaskLabels
from .usage import UsageMeter, replica_name
from .usage_log import usage_log_for

log = logging.getLogger("memvit.server")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("MEMVIT_DEVICE=cuda but no CUDA device is available")
    return torch.device(name)


def build_engine(settings: Settings) -> MemoryViT:
    """The base model the settings describe (the embedded demo when none is configured)."""
    device, dtype = resolve_device(settings.device), DTYPES[settings.dtype]
    like = {"device": device, "dtype": dtype, "batch_invariant": settings.batch_invariant}
    if settings.uses_demo:
        from .demo import BASE_WEIGHTS

        engine = MemoryViT.from_timm(weights=BASE_WEIGHTS, **like)
    else:
        labels = None
        if settings.labels_file is not None:
            lines = settings.labels_file.read_text().splitlines()
            labels = tuple(line.strip() for line in lines if line.strip())
        engine = MemoryViT.from_timm(settings.model, weights=settings.weights, labels=labels, **like)
    engine.cuda_graphs, engine.kernels = settings.cuda_graphs, settings.kernels
    return engine


def preflight(settings: Settings) -> None:
    """Cheap checks that turn misconfiguration into one clear line before the server starts."""
    if settings.weights is not None and not settings.weights.is_file():
        raise ValueError(f"MEMVIT_WEIGHTS: weights file not found: {settings.weights}")
    if settings.labels_file is not None and not settings.labels_file.is_file():
        raise ValueError(f"MEMVIT_LABELS_FILE: file not found: {settings.labels_file}")
    if settings.uses_demo:
        from .demo import BASE_WEIGHTS

        if not BASE_WEIGHTS.is_file():
            raise ValueError(f"no model configured and the embedded demo is missing ({BASE_WEIGHTS})")
    device = resolve_device(settings.device)
    if settings.decode_device == "device" and settings.decode != "exact":
        raise ValueError("MEMVIT_DECODE_DEVICE=device decodes every pixel: use it with MEMVIT_DECODE=exact")
    if settings.kernels == "triton" and device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError("MEMVIT_KERNELS=triton needs a CUDA device; use auto or torch on this machine")
    check_credentials(settings)
    # Creates a directory, or fails if it cannot be written; lists a bucket, or fails if it cannot.
    try:
        open_store(settings.adapter_store)
    except StoreUnavailableError as exc:
        raise ValueError(f"MEMVIT_ADAPTER_STORE: {exc}") from None


def _seed_demo_store(settings: Settings, registry: AdapterRegistry) -> None:
    """With the demo model, a brand-new store starts from the demo's adapters (once in its life)."""
    from .demo import demo_adapters

    if settings.uses_demo and registry.seed_once({path.stem: path for path in demo_adapters()}):
        log.info("seeded the new adapter store %s with the demo adapters", registry.store.location)


def _load(settings: Settings, metrics: Metrics) -> tuple[MemoryViT, AdapterRegistry]:
    """The slow, blocking part of start-up (run in a thread): the model, then the registry's index."""
    engine = build_engine(settings)
    store = open_store(settings.adapter_store)
    registry = AdapterRegistry(
        LiveAdapters(engine),
        store,
        max_bundle_bytes=settings.max_bundle_bytes,
        resident_adapters=settings.resident_adapters,
        resident_bytes=settings.resident_bytes,
        max_tasks=settings.max_tasks_per_request,
        metrics=metrics,
    )
    registry.open()
    _seed_demo_store(settings, registry)
    return engine, registry


def device_decoder_for(settings: Settings, engine: MemoryViT, decoder: ImageDecoder) -> DeviceDecoder | None:
    """The device decoder ``MEMVIT_DECODE_DEVICE`` asks for, or None (every image on CPU workers)."""
    on_gpu = engine.device.type == "cuda" and settings.decode == "exact"
    if settings.decode_device == "device" or (settings.decode_device == "auto" and on_gpu):
        return DeviceDecoder(decoder, engine.device)
    return None


async def start_service(state: AppState) -> None:
    """Loads the model and the registry, starts the batcher, the pipeline and the background tasks,
    then sets ``state.service``; on failure, says why in one line and sends this process SIGTERM."""
    settings = state.settings
    try:
        engine, registry = await asyncio.to_thread(_load, settings, state.metrics)
    except Exception as exc:  # configuration or weights problems: say so in one line and stop
        log.error("cannot start: %s", exc)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    live = registry.live
    decoder = ImageDecoder(
        engine,
        max_bytes=settings.max_image_bytes,
        max_pixels=settings.max_image_pixels,
        decode=settings.decode,
    )
    device_decoder = device_decoder_for(settings, engine, decoder)
    batcher = DynamicBatcher(
        live,
        max_batch=settings.max_batch,
        max_wait=settings.max_wait_ms / 1000,
        max_queue=settings.max_queue,
        metrics=state.metrics,
        fair=settings.fair_batching,
        decoder=device_decoder,
    )
    await batcher.start()
    decode_pool = ThreadPoolExecutor(max_workers=settings.decode_threads, thread_name_prefix="decode")
    usage_log = usage_log_for(registry.store) if settings.usage_log else None
    meter = UsageMeter(usage_log, replica_name(settings.replica_name), settings.usage_interval_seconds)
    pipeline = ClassifyPipeline(
        registry,
        decoder,
        batcher,
        decode_pool,
        max_image_bytes=settings.max_image_bytes,
        decode_order=FairPool(decode_pool) if settings.fair_batching else None,
        metrics=state.metrics,
        usage=meter,
        device_decoder=device_decoder,
    )
    state.service = Service(engine, live, registry, pipeline, batcher, decode_pool, meter)
    state.tasks.append(
        asyncio.create_task(_poll_store(state.service, settings, state.metrics), name="store-poller")
    )
    if usage_log is not None:
        state.tasks.append(asyncio.create_task(meter.run_forever(), name="usage-writer"))
    # Off the start-up path: a local store walks a directory per adapter (100,000 of them), and a
    # stale temp file is garbage, never a registration.
    state.tasks.append(asyncio.create_task(asyncio.to_thread(registry.store.clean_temp_files), name="clean"))
    _update_gauges(state.service, state.metrics)
    state.metrics.ready.set(1)
    spec = engine.spec
    log.info(
        "ready: %s (%s) on %s/%s, JPEGs decoded on %s, %d adapters registered (v%d), store %s",
        spec.arch, engine.source, engine.device, engine.dtype,
        "the CPU" if device_decoder is None else device_decoder.device, len(registry), registry.version,
        settings.adapter_store,
    )  # fmt: skip


async def _poll_store(service: Service, settings: Settings, metrics: Metrics) -> None:
    while True:
        await asyncio.sleep(settings.store_poll_seconds)
        try:
            await asyncio.to_thread(service.registry.sync)
            _update_gauges(service, metrics)
        except Exception:  # a bad poll must not end polling
            log.exception("adapter store poll failed")


def _update_gauges(service: Service, metrics: Metrics) -> None:
    live = service.live.current
    metrics.adapters_loaded.set(len(live))
    metrics.adapter_set_version.set(live.version)
    metrics.adapters_registered.set(len(service.registry))


async def stop_service(state: AppState) -> None:
    """Shutdown: every background task cancelled, the service closed, the usage since the last record
    written (a stop loses nothing)."""
    for task in state.tasks:
        task.cancel()
    for task in state.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if state.service is not None:
        await state.service.close()
        try:
            await asyncio.to_thread(state.service.usage.flush)
        except Exception as exc:
            log.error("usage since the last record could not be written: %s", exc)


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
