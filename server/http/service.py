"""A service, assembled: what the routes serve from, in the single process and an API process alike.

``assemble`` builds the request side (the decoders, their pool, ``ClassifyPipeline``) around a runner;
what differs between processes is only what is handed to it:

- the process that holds the model (one process, or a group's model process): ``start_service``
  loads the engine and the registry, starts the engine loop (server/inference/engine_loop.py) and hands a
  ``LocalRunner`` over;
- an API process (server/frontend/api_process.py): the engine's description, a replica of the
  registry and a ``RemoteRunner`` over the link (server/frontend/remote.py). It decodes uploads, and
  with the device decoder only checks them (``JpegCheck``): it never creates a CUDA context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.memory_core.runtime import cuda_host_waits, exact_float32

from ..edge.principal import check_credentials
from ..inference.device_decode import DeviceDecoder, JpegCheck
from ..inference.device_runner import DeviceRunner
from ..inference.engine_loop import EngineLoop
from ..inference.fair_queue import FairPool
from ..inference.images import ImageDecoder
from ..inference.runner import LocalRunner, Runner, counting
from ..inference.warmup import warm_up
from ..registry import AdapterRegistry
from ..settings import Settings
from ..store import StoreUnavailableError, open_store
from ..telemetry.gc_pauses import settle_heap
from ..telemetry.metrics import Metrics
from ..tenancy.usage import UsageMeter, replica_name
from ..tenancy.usage_log import usage_log_for
from .pipeline import ClassifyPipeline
from .state import AppState, Service

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
    cuda_host_waits(device, settings.cuda_waits)  # before the process's first tensor on the device
    like = {"device": device, "dtype": dtype, "batch_invariant": settings.batch_invariant}
    if settings.uses_demo:
        from ..demo import BASE_WEIGHTS

        engine = MemoryViT.from_timm(weights=BASE_WEIGHTS, **like)
    else:
        labels = None
        if settings.labels_file is not None:
            lines = settings.labels_file.read_text().splitlines()
            labels = tuple(line.strip() for line in lines if line.strip())
        engine = MemoryViT.from_timm(settings.model, weights=settings.weights, labels=labels, **like)
    engine.cuda_graphs, engine.kernels = settings.cuda_graphs, settings.kernels
    exact_float32(engine.device, engine.dtype)  # a float32 server answers in float32, whatever the batch
    switch_ms = settings.engine_gil_switch_ms(engine.device.type)
    if switch_ms is not None:  # this process runs the engine's threads (settings.py)
        sys.setswitchinterval(switch_ms / 1e3)
        log.info("GIL switch interval %.2f ms", switch_ms)
    return engine


def preflight(settings: Settings) -> None:
    """Cheap checks that turn misconfiguration into one clear line before the server starts."""
    if settings.weights is not None and not settings.weights.is_file():
        raise ValueError(f"MEMVIT_WEIGHTS: weights file not found: {settings.weights}")
    if settings.labels_file is not None and not settings.labels_file.is_file():
        raise ValueError(f"MEMVIT_LABELS_FILE: file not found: {settings.labels_file}")
    if settings.uses_demo:
        from ..demo import BASE_WEIGHTS

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


def decodes_on_device(settings: Settings, device: torch.device) -> bool:
    """Whether JPEGs are decoded on the model's device (``MEMVIT_DECODE_DEVICE``)."""
    on_gpu = device.type == "cuda" and settings.decode == "exact"
    return settings.decode_device == "device" or (settings.decode_device == "auto" and on_gpu)


def assemble(
    settings: Settings,
    *,
    engine: Any,
    live: Any,
    registry: Any,
    runner: Runner,
    usage: Any,
    engine_loop: EngineLoop | None = None,
    check_inline: bool = False,
) -> Service:
    """The request side around ``runner``. ``engine``: the model, or its description (labels, input
    shape and preprocessing are all the request side reads). ``check_inline``: the device path's
    JPEG checks on the event loop (``ClassifyPipeline``), where the pass is another process's."""
    decoder = ImageDecoder(
        engine,
        max_bytes=settings.max_image_bytes,
        max_pixels=settings.max_image_pixels,
        decode=settings.decode,
    )
    on_device = decodes_on_device(settings, torch.device(engine.device))
    pool = ThreadPoolExecutor(max_workers=settings.decode_threads, thread_name_prefix="decode")
    pipeline = ClassifyPipeline(
        runner,
        JpegCheck(decoder) if on_device else decoder,
        pool,
        max_image_bytes=settings.max_image_bytes,
        stack=not on_device,
        decode_order=FairPool(pool) if settings.fair_batching else None,
        check_inline=check_inline and on_device,
    )
    return Service(engine, live, registry, pipeline, pool, usage, engine_loop)


def _seed_demo_store(settings: Settings, registry: AdapterRegistry) -> None:
    """With the demo model, a brand-new store starts from the demo's adapters (once in its life)."""
    from ..demo import demo_adapters

    if settings.uses_demo and registry.seed_once({path.stem: path for path in demo_adapters()}):
        log.info("seeded the new adapter store %s with the demo adapters", registry.store.location)


def _load(settings: Settings, metrics: Metrics) -> tuple[MemoryViT, AdapterRegistry, EngineLoop]:
    """The slow, blocking part of start-up (run in a thread): the model, the registry's index, and
    the engine loop, started with the graphs it will replay captured (server/inference/warmup.py)."""
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
    device_decoder = None
    if decodes_on_device(settings, engine.device):
        cpu = ImageDecoder(engine, max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels)
        device_decoder = DeviceDecoder(cpu, engine.device, tuple(settings.device_decode_call_sizes))
        if device_decoder.call_sizes:
            sizes = ", ".join(map(str, device_decoder.call_sizes))
            log.info("device decoder calls padded to %s images", sizes)
    loop = EngineLoop(
        registry.live,
        DeviceRunner(engine, device_decoder, lanes=settings.engine_decode_threads(engine.device.type)),
        max_batch=settings.max_batch,
        max_wait=settings.max_wait_ms / 1000,
        linger=settings.batch_linger,
        max_queue=settings.max_queue,
        metrics=metrics,
        fair=settings.fair_batching,
        registered=lambda version: registry.info(version).adapters,
        warm=lambda adapters: warm_up(engine, adapters, settings.max_batch, settings.max_tasks_per_request),
        graphs_beside=settings.graphs_beside_serving,
    )
    loop.start()
    return engine, registry, loop


async def start_service(state: AppState) -> None:
    """Loads the model and the registry, starts the engine loop and the background tasks, then sets
    ``state.service``; on failure, says why in one line and sends this process SIGTERM."""
    settings = state.settings
    try:
        engine, registry, loop = await asyncio.to_thread(_load, settings, state.metrics)
    except Exception as exc:  # configuration or weights problems: say so in one line and stop
        log.error("cannot start: %s", exc)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    usage_log = usage_log_for(registry.store) if settings.usage_log else None
    meter = UsageMeter(usage_log, replica_name(settings.replica_name), settings.usage_interval_seconds)
    loop.count = counting(meter, state.metrics)  # before ready: no batch has run yet
    runner = LocalRunner(registry, loop)
    state.service = assemble(
        settings,
        engine=engine,
        live=registry.live,
        registry=registry,
        runner=runner,
        usage=meter,
        engine_loop=loop,
    )
    state.tasks.append(
        asyncio.create_task(_poll_store(state.service, settings, state.metrics), name="store-poller")
    )
    if usage_log is not None:
        state.tasks.append(asyncio.create_task(meter.run_forever(), name="usage-writer"))
    # Off the start-up path: a local store walks a directory per adapter (100,000 of them), and a
    # stale temp file is garbage, never a registration.
    state.tasks.append(asyncio.create_task(asyncio.to_thread(registry.store.clean_temp_files), name="clean"))
    update_gauges(state.service, state.metrics)
    # what is loaded lives as long as the process: a full collection under load then walks only what
    # requests made, not the ~430,000 objects of torch and the model (telemetry/gc_pauses.py)
    settle_heap(state.metrics)
    state.metrics.watch_graphs(engine)
    state.metrics.ready.set(1)
    spec = engine.spec
    log.info(
        "ready: %s (%s) on %s/%s, JPEGs decoded on %s, %d adapters registered (v%d), store %s",
        spec.arch, engine.source, engine.device, engine.dtype,
        engine.device if loop.runner.decoder is not None else "the CPU", len(registry), registry.version,
        settings.adapter_store,
    )  # fmt: skip


async def _poll_store(service: Service, settings: Settings, metrics: Metrics) -> None:
    while True:
        await asyncio.sleep(settings.store_poll_seconds)
        try:
            await asyncio.to_thread(service.registry.sync)
            update_gauges(service, metrics)
        except Exception:  # a bad poll must not end polling
            log.exception("adapter store poll failed")


def update_gauges(service: Service, metrics: Metrics) -> None:
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
