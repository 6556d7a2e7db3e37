"""An API process: the single-process server's app (routes, guard, keys, caps, error bodies, the
protocol), served by uvicorn on the supervisor's port (``SO_REUSEPORT``), in one of two roles. It
listens on the port only once it can answer (``ListenWhenAble``): until then the kernel would hand it
its share of the connections, to be answered "not ready" while another process stands ready.

- model-process front end: ``follow_model`` builds the service from the model process (server/
  frontend/remote.py) instead of loading a model, and follows it: while the model process is down
  (starting, restarted) ``/readyz`` and every route that needs it answer 503, calls in flight get
  503 with ``Retry-After``, and the process reconnects when it is back. It decodes uploads itself
  (the same ``ImageDecoder``, in ``decode_workers`` threads) and runs no torch kernels but the
  decoder's, on one thread.
- replicas: the whole server (``app.start_service``), with torch's threads and the decoders divided
  among the replicas, and each key's limits too (server/frontend/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import torch
import uvicorn

from ..http.app import create_app
from ..http.service import assemble, start_service
from ..http.state import AppState, Service
from ..http.timeouts import header_timeout_protocol
from ..settings import Settings
from ..store import open_store
from ..telemetry.gc_pauses import settle_heap
from ..telemetry.task_labels import TaskLabels
from ..tenancy.usage_log import usage_log_for
from .labels import LabelCache
from .limits import RemoteLimiter, ShareLimiter
from .link import LinkDownError
from .listen import Able, ListenWhenAble, bound
from .model_process import SOCKET, die_with_parent
from .remote import EngineInfo, ModelLink, RemoteRegistry, RemoteRunner, RemoteUsage, ResidentCount
from .shared_metrics import SharedMetrics
from .shm_arena import Arena

log = logging.getLogger("memvit.server.api")
ARENA_BYTES = 32 << 20  # per API process: ~50 decoded 224x224 images in flight; more go inline
RECONNECT_SECONDS = 0.1


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def arena_size(processes: int) -> int:
    """``ARENA_BYTES``, or less where /dev/shm is small (Docker's default is 64 MiB): writing past
    what the mount can hold would be a SIGBUS, so each process takes at most half its share."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return ARENA_BYTES
    return min(ARENA_BYTES, free // (2 * processes))


async def follow_model(state: AppState, link: ModelLink, processes: int, ready: Callable[[], None]) -> None:
    """``state.service`` from the model process while it answers, None while it does not."""
    settings, metrics = state.settings, state.metrics
    service: Service | None = None
    size = arena_size(processes)
    arena = Arena(size) if size >= 1 << 20 else None
    try:
        while True:
            waited = 0.0
            while True:
                try:
                    await link.connect()
                    break
                except OSError:
                    if waited >= 5 and waited - RECONNECT_SECONDS < 5:
                        log.warning("waiting for the model process (%s)", link.path)
                    waited += RECONNECT_SECONDS
                    await asyncio.sleep(RECONNECT_SECONDS)
            try:
                if service is None:
                    service = await asyncio.to_thread(_build, settings, link, arena, await link.call("info"))
                    settle_heap(metrics)  # what is loaded is out of the collector's reach
                else:
                    await asyncio.to_thread(service.registry.sync)
                service.live.set(await link.call("resident"))
            except Exception as exc:  # it went away again while we asked: wait for the next one
                log.warning("the model process did not answer: %s", exc)
                await link.wait_closed()
                continue
            state.service = service
            metrics.ready.set(1)
            ready()
            log.info("serving with the model process (registry v%d)", service.registry.version)
            poller = asyncio.create_task(_poll(service, link, settings.store_poll_seconds))
            await link.wait_closed()
            poller.cancel()
            state.service = None
            metrics.ready.set(0)
            log.warning("the model process went away; answering 503 until it is back")
    finally:
        await link.close()
        if arena is not None:
            with contextlib.suppress(Exception):
                arena.close()


def _build(settings: Settings, link: ModelLink, arena: Arena | None, info: dict) -> Service:
    """The service as this process has it: the request side (``service.assemble``, as one process's)
    around a runner across the link. No weights, and no CUDA context: it never touches the GPU."""
    engine = EngineInfo(info)
    store = open_store(settings.adapter_store)
    registry = RemoteRegistry(
        link, engine, store, max_bundle_bytes=settings.max_bundle_bytes, max_tasks=info["max_tasks"]
    )
    registry.open()
    link.registry = registry  # refreshed when another process changes the registry

    def catalog_labels(name: str) -> tuple[str, ...] | None:
        entry = registry.catalog.get(name)
        return entry.labels if entry is not None and entry.labels else None

    async def ask(keys: list[bytes]) -> dict[bytes, tuple[str, ...]]:
        return await link.call("labels", keys)

    runner = RemoteRunner(link, arena, registry, LabelCache(engine.labels, catalog_labels, ask))
    usage = RemoteUsage(usage_log_for(store) if settings.usage_log else None)
    return assemble(
        settings,
        engine=engine,
        live=ResidentCount(),
        registry=registry,
        runner=runner,
        usage=usage,
        check_inline=True,  # the hop to a decode worker costs more than the check (http/pipeline.py)
    )


async def _poll(service: Service, link: ModelLink, seconds: float) -> None:
    """The catalog replica follows the store's journal, as another replica's would."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(service.registry.sync)
            service.live.set(await link.call("resident"))
        except LinkDownError:
            pass  # the model process went away: follow_model notices and waits for the next one
        except Exception as exc:  # a bad poll must not end polling
            log.warning("poll failed: %s", exc)


def api_main(
    settings: Settings,
    port: int,
    directory: Path,
    index: int,
    mode: str,
    processes: int,
    ready: Event,
) -> None:
    """An API process's entry point (spawned by the supervisor): uvicorn on the shared port until
    SIGTERM, then a graceful stop (running requests finish, up to 10 s)."""
    die_with_parent()
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:%(name)s: %(message)s")
    share = max(1, cores() // processes)
    if settings.decode_workers is None:  # the cores, divided among the processes that decode
        settings = settings.model_copy(update={"decode_workers": share})
    labels = TaskLabels(settings.metrics_tasks, settings.metrics_top_tasks)
    able = Able()  # set once this process can answer: then, and only then, it listens
    if mode == "replicas":
        torch.set_num_threads(share)
        metrics = SharedMetrics(directory, f"replica-{index}", labels)

        async def start(state: AppState) -> None:
            state.tasks.append(asyncio.create_task(metrics.publish_forever(), name="metrics"))
            await start_service(state)
            if state.service is not None:
                able.set()

        app = create_app(settings, metrics=metrics, start=start, limiter=ShareLimiter(processes, metrics))
    else:
        torch.set_num_threads(1)  # the decoder's few tensor operations; the model process has the cores
        metrics = SharedMetrics(directory, f"api-{index}", labels)
        link = ModelLink(directory / SOCKET)

        async def start(state: AppState) -> None:
            state.tasks.append(asyncio.create_task(metrics.publish_forever(), name="metrics"))
            await follow_model(state, link, processes, able.set)

        app = create_app(settings, metrics=metrics, start=start, limiter=RemoteLimiter(link, metrics))
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.header_timeout_seconds),
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the supervisor stops the group in order
    ListenWhenAble(config, bound(settings.host, port), able, ready.set).run()
