"""The model process: the engine, the registry and its resident set, the batcher, the usage meter and
the keys' limits, behind a Unix socket that the API processes call (server/link.py).

It is the single-process server's service (``app.start_service``), without HTTP. ``run`` is
``ClassifyPipeline.run`` for a request an API process is decoding: it starts at once, so the
adapters are pinned and the images announced to the batcher while they decode (as in one process),
and its awaitable resolves when ``deliver`` brings the decoded images (server/frontend/wire.py).
What goes back is the request's logits and each adapter's labels from the snapshot that answered;
usage and the per-key and per-task metrics are counted here, where the pass ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import signal
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from ..app import _update_gauges, start_service, stop_service
from ..errors import RetryLaterError
from ..link import Handler, LinkServer, current_peer
from ..pipeline import Tenant
from ..settings import Settings
from ..shm_arena import Reader
from ..stages import begin_stages
from ..state import AppState
from ..task_labels import TaskLabels
from .limits import Admissions
from .remote import Answer
from .shared_metrics import SharedMetrics
from .wire import Images, Payload, unpack

log = logging.getLogger("memvit.server.model")
DELIVERY_SECONDS = 120.0  # an API process that never sends the images it announced: the batcher stops waiting
SOCKET = "model.sock"


class ImagesWithdrawnError(RetryLaterError):
    """The API process will not send the images (a bad upload, or its client went away)."""


class ModelHandlers:
    """The calls an API process makes; ``state.service`` is loaded."""

    def __init__(self, state: AppState) -> None:
        assert state.service is not None
        self.state = state
        self.service = state.service
        self.reader = Reader()
        self.admissions = Admissions(state.metrics)
        self._waiting: dict[tuple[int, int], asyncio.Future[Payload | None]] = {}

    def table(self) -> dict[str, Handler]:
        a = self.admissions
        return {
            "info": self.info, "run": self.run, "deliver": self.deliver, "register": self.register,
            "delete": self.delete, "training": self.training, "invalid": self.invalid,
            "resident": self.resident, "admit": a.admit, "charge": a.charge, "release": a.release,
        }  # fmt: skip

    async def info(self) -> dict[str, Any]:
        engine = self.service.engine
        return {
            "labels": engine.labels,
            "spec": engine.spec,
            "source": engine.source,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "data_config": engine.data_config(),
            "in_chans": engine.base.patch_embed.proj.in_channels,
            "num_classes": int(engine.base.num_classes),
            "max_tasks": self.service.registry.max_tasks,
        }

    def _slot(self, number: int) -> asyncio.Future[Payload | None]:
        key = (current_peer.get(), number)
        if key not in self._waiting:
            self._waiting[key] = asyncio.get_running_loop().create_future()
        return self._waiting[key]

    async def run(self, number: int, count: int, tasks: list[str] | None, tenant: Tenant) -> Answer:
        slot, key = self._slot(number), (current_peer.get(), number)

        async def images() -> Images:
            try:
                payload = await asyncio.wait_for(slot, DELIVERY_SECONDS)
            finally:
                self._waiting.pop(key, None)
            if payload is None:
                raise ImagesWithdrawnError("the request's images were withdrawn")
            return unpack(payload, self.reader)

        stages = begin_stages()  # this call's task: the batcher adds the queue, copy and pass here
        out = await self.service.pipeline.run(images(), count, tasks, tenant)
        adapter_set = out.adapter_set
        return Answer(
            base=out.base.numpy(),
            adapters={name: values.numpy() for name, values in out.adapters.items()},
            labels={name: adapter_set[name].weights.labels for name in out.adapters},
            registry=self.service.registry.info(adapter_set.version),
            stages=dict(stages.seconds),
        )

    async def deliver(self, number: int, payload: Payload | None) -> None:
        slot = self._slot(number)
        if not slot.done():
            slot.set_result(payload)

    def forget(self, peer: int) -> None:
        """An API process went away: the images it announced will not come, its slots are free."""
        for key in [k for k in self._waiting if k[0] == peer]:
            slot = self._waiting.pop(key)
            if not slot.done():
                slot.set_result(None)
        self.admissions.forget(peer)

    async def register(self, data: bytes, replace: bool) -> Any:
        return await asyncio.to_thread(self.service.registry.register, data, replace=replace)

    async def delete(self, name: str) -> Any:
        return await asyncio.to_thread(self.service.registry.delete, name)

    async def training(self, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.service.registry.training, name)

    async def invalid(self) -> dict[str, str]:
        return self.service.registry.invalid

    async def resident(self) -> int:
        _update_gauges(self.service, self.state.metrics)
        return len(self.service.live.current)


async def serve_model(settings: Settings, directory: Path, ready: Callable[[], None]) -> int:
    """Until SIGTERM: load, then answer the API processes. 0 after a stop, 1 if loading failed."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    labels = TaskLabels(settings.metrics_tasks, settings.metrics_top_tasks)
    metrics = SharedMetrics(directory, "model", labels)
    state = AppState(settings=settings, metrics=metrics)
    state.tasks.append(asyncio.create_task(metrics.publish_forever(), name="metrics"))
    await start_service(state)  # on failure it has logged why and sent this process SIGTERM
    if state.service is None:
        await stop_service(state)
        return 1
    handlers = ModelHandlers(state)
    server = LinkServer(directory / SOCKET, handlers.table(), on_disconnect=handlers.forget)
    await server.start()
    ready()
    log.info("model process ready; answering the API processes on %s", directory / SOCKET)
    await stop.wait()
    await server.close()
    await stop_service(state)  # the batcher, the store poller, the usage since the last record
    with contextlib.suppress(BufferError):  # a tensor may still view the memory; the exit unmaps it
        handlers.reader.close()
    return 0


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when the supervisor dies, however it dies (a SIGKILL
    gives it no chance to stop its children): no orphan keeps the port or the model. Elsewhere, a
    no-op."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def model_main(settings: Settings, directory: Path, ready: Event) -> None:
    """The model process's entry point (spawned by the supervisor)."""
    die_with_parent()
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:%(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the supervisor stops the group in order
    raise SystemExit(asyncio.run(serve_model(settings, directory, ready.set)))
