"""The model process: the engine, the registry and its resident set, the engine loop, the usage meter
and the keys' limits, behind a Unix socket that the API processes call (server/frontend/link.py).

It is the single-process server's service (``service.start_service``) without HTTP, and it only
forms batches: no event loop stands between a request and its pass. A request is two frames from an
API process (or one: ``run`` carrying the images), read by that connection's thread:

- ``run``: the runner's work starts at once (as ``LocalRunner``'s does in one process): the adapters
  asked for pinned (loaded first, on the loader's threads, if they are not resident) and the images
  announced to the engine loop, so a forming batch waits for them while the API process decodes;
- ``deliver``: the decoded images (server/frontend/wire.py: read in place from shared memory), or
  None when they will not come (a bad upload, a client gone).

Once both are in, the request is queued on the engine loop (server/inference/engine_loop.py). Its answer comes
back from the engine's collector thread (``ConnectionSink``): the batch's answers for one API
process in one frame (one pickle, one write, one read there), each the request's arrays as bytes
and its labels by key (labels.py), never an object per task. Usage and the per-key and per-task
metrics are counted here, where the pass ran. The event loop serves the control path only:
registrations, the keys' limits, descriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from memvit.memory_core import BASE_TASK

from ..errors import RetryLaterError
from ..http.service import start_service, stop_service
from ..http.state import AppState
from ..inference.answers import Answer
from ..inference.engine_loop import Job, Result
from ..inference.runner import as_items
from ..registry import Pin
from ..settings import Settings
from ..telemetry.task_labels import TaskLabels
from .labels import LabelKeys
from .limits import Admissions
from .link import BATCH, Connection, LinkServer, _frame
from .model_control import ControlCalls
from .remote import answer_to_wire
from .shared_metrics import SharedMetrics
from .shm_arena import Reader
from .wire import Payload, unpack

log = logging.getLogger("memvit.server.model")
DELIVERY_SECONDS = 120.0  # an API process that never sends the images it announced: the engine stops waiting
SOCKET = "model.sock"
_WAITING = object()  # a pin or images not in yet


class ImagesWithdrawnError(RetryLaterError):
    """The API process will not send the images (a bad upload, or its client went away)."""


@dataclass(eq=False, slots=True)
class Pending:
    """A request announced by an API process: its pin and its images, whichever comes in last."""

    connection: Connection
    call_id: int
    count: int
    adapters: tuple[str, ...] | None
    tasks: list[str] | None
    tenant: str
    weight: float
    top_k: int
    logits: bool
    since: float = field(default_factory=time.monotonic)
    pin: Any = _WAITING  # Pin, or the error that refused it
    images: Any = _WAITING  # the payload, or None: withdrawn

    def release(self) -> None:
        if isinstance(self.pin, Pin):
            self.pin.release()


class ConnectionSink:
    """An API process's answers, from the engine's collector thread: one write for a batch's."""

    def __init__(self, handlers: ModelHandlers, connection: Connection) -> None:
        self.handlers, self.connection = handlers, connection

    def deliver(self, finished: list[tuple[Job, Result]]) -> None:
        keys, answers, connection = self.handlers.keys.cached(), [], self.connection
        for job, result in finished:
            pending: Pending = job.context
            pending.release()
            if isinstance(result, Answer):
                answers.append((pending.call_id, True, answer_to_wire(result, keys)))
            else:
                answers.append(connection.failed(pending.call_id, result))
        connection.send([_frame((BATCH, True, answers))])  # one pickle, one frame for the batch's


class ModelHandlers(ControlCalls):
    """The calls an API process makes; ``state.service`` is loaded. The data path is here, the control
    path (registrations, descriptions) is ``ControlCalls`` (model_control.py)."""

    def __init__(self, state: AppState, loop: asyncio.AbstractEventLoop) -> None:
        assert state.service is not None and state.service.engine_loop is not None
        self.state, self.service, self.metrics = state, state.service, state.metrics
        self.loop = loop  # the control path's
        self.engine = state.service.engine_loop
        self.reader = Reader()
        self.admissions = Admissions(state.metrics)
        self.keys = LabelKeys()
        self._pending: dict[tuple[int, int], Pending] = {}
        self._sinks: dict[int, ConnectionSink] = {}
        self._early: dict[tuple[int, int], Any] = {}
        self.server: LinkServer | None = None
        self._tokens = itertools.count()
        self._refreshes: dict[int, tuple[set[int], asyncio.Event]] = {}
        self._lock = threading.Lock()

    def inline(self) -> dict[str, Callable[..., None]]:
        """The data path's calls, run on the connection's reader thread."""
        return {"run": self.run, "deliver": self.deliver}

    def table(self) -> dict[str, Any]:
        """The control path's calls, run on the event loop."""
        a = self.admissions
        return {
            "info": self.info, "register": self.register, "delete": self.delete, "training": self.training,
            "invalid": self.invalid, "resident": self.resident, "labels": self.labels, "admit": a.admit,
            "charge": a.charge, "release": a.release, "refreshed": self.refreshed,
        }  # fmt: skip

    # -- the data path (reader threads, then the engine's threads) ---------------------------------------
    def run(self, connection: Connection, call_id: int, number: int, count: int, tasks: list[str] | None,
            tenant: str, weight: float, top_k: int, logits: bool,
            images: Any = _WAITING) -> None:  # fmt: skip
        """``images``: the payload, when the API process had it before the call left (else a
        ``deliver`` brings it)."""
        adapters = None if tasks is None else tuple(t for t in tasks if t != BASE_TASK)
        pending = Pending(connection, call_id, count, adapters, tasks, tenant, weight, top_k, logits)
        key = (connection.peer, number)
        with self._lock:
            self._pending[key] = pending
            # or a deliver read first (never, in order)
            pending.images = images if images is not _WAITING else self._early.pop(key, _WAITING)
        self.engine.announce(count)
        # Unfiltered (a small registry): every adapter, less any deleted meanwhile or invalid here.
        wanted = self.service.registry.every_name() if adapters is None else adapters
        try:
            self.service.registry.acquire_then(
                wanted, lambda pin: self._arrived(key, pin=pin), optional=adapters is None
            )
        except Exception as exc:  # refused before any load (too many adapters)
            self._arrived(key, pin=exc)

    def deliver(self, connection: Connection, call_id: int, number: int, payload: Payload | None) -> None:
        self._arrived((connection.peer, number), images=payload)

    def _arrived(self, key: tuple[int, int], **part: Any) -> None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                if "images" in part and len(self._early) < 1024:
                    self._early[key] = part["images"]
                return
            for name, value in part.items():
                setattr(pending, name, value)
            if pending.pin is _WAITING or pending.images is _WAITING:
                return
            del self._pending[key]
        self._queue(pending)

    def _queue(self, pending: Pending) -> None:
        connection = pending.connection
        try:
            if isinstance(pending.pin, BaseException):
                raise pending.pin
            if pending.images is None:
                raise ImagesWithdrawnError("the request's images were withdrawn")
            items = as_items(unpack(pending.images, self.reader), pending.count)
        except Exception as exc:
            self.engine.withdraw(pending.count)
            pending.release()
            connection.send([connection.failure(pending.call_id, exc)])
            return
        sink = self._sink(connection)
        job = Job(items, pending.adapters, pending.tasks, sink, top_k=pending.top_k, logits=pending.logits,
                  flow=pending.tenant, weight=pending.weight, context=pending)  # fmt: skip
        try:
            self.engine.submit(job, announced=True)
        except Exception as exc:  # overloaded
            pending.release()
            connection.send([connection.failure(pending.call_id, exc)])

    def _sink(self, connection: Connection) -> ConnectionSink:
        sink = self._sinks.get(connection.peer)
        if sink is None or sink.connection is not connection:
            sink = self._sinks[connection.peer] = ConnectionSink(self, connection)
        return sink

    def sweep(self, older_than: float = DELIVERY_SECONDS) -> None:
        """Requests whose images never came are withdrawn (the engine loop stops waiting for them)."""
        now = time.monotonic()
        with self._lock:
            stale = [
                k for k, p in self._pending.items() if p.images is _WAITING and now - p.since > older_than
            ]
        for key in stale:
            self._arrived(key, images=None)

    def forget(self, peer: int) -> None:
        """An API process went away: the images it announced will not come, its slots are free."""
        with self._lock:
            keys = [k for k in self._pending if k[0] == peer]
        for key in keys:
            self._arrived(key, images=None)
        self._sinks.pop(peer, None)
        self.loop.call_soon_threadsafe(self.admissions.forget, peer)


async def _sweep_forever(handlers: ModelHandlers) -> None:
    while True:
        await asyncio.sleep(DELIVERY_SECONDS / 10)
        handlers.sweep()


async def serve_model(settings: Settings, directory: Path, ready: Callable[[], None]) -> int:
    """Until SIGTERM: load, then answer the API processes. 0 after a stop, 1 if loading failed."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    labels = TaskLabels(settings.metrics_tasks, settings.metrics_top_tasks)
    metrics = SharedMetrics(directory, "model", labels)
    state = AppState(settings=settings, metrics=metrics)
    state.tasks.append(asyncio.create_task(metrics.publish_forever(), name="metrics"))
    await start_service(state)  # on failure it has logged why and sent this process SIGTERM
    if state.service is None:
        await stop_service(state)
        return 1
    handlers = ModelHandlers(state, loop)
    server = LinkServer(
        directory / SOCKET,
        handlers.table(),
        loop=loop,
        inline=handlers.inline(),
        on_disconnect=handlers.forget,
    )
    handlers.server = server
    await server.start()
    state.tasks.append(asyncio.create_task(_sweep_forever(handlers), name="sweep"))
    ready()
    log.info("model process ready; answering the API processes on %s", directory / SOCKET)
    await stop.wait()
    await server.close()
    await stop_service(state)  # the engine loop, the store poller, the usage since the last record
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
