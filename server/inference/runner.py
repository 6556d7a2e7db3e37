"""The seam between the request side (read, check, answer: server/http/pipeline.py) and what runs the pass.

    answer = await runner.run(Ask(count, tasks, tenant, top_k, logits), images)

One interface, two runners: ``LocalRunner`` (here, the process that holds the model: the single
process, and the model process of a group) and ``RemoteRunner`` (an API process's, across the link:
server/frontend/remote.py). ``images`` is an awaitable of the request's decoded images, or items for
the device decoder (server/inference/device_decode.py): the runner starts at once, pinning the adapters asked
for and announcing the images to the engine loop while they decode, so a forming batch waits for them.

What the runner does for a request, in the process that runs the pass:
- its adapters made resident (loaded from the store if they are not) and pinned until its batch has
  run, so no other request's cold load evicts them;
- its images queued as its key's (its share of the passes by its weight), in one batch with others;
- its answer cut from the batch's (server/inference/answers.py), from the one snapshot that computed it;
- what was computed counted for the key that asked, by the engine loop for each batch
  (``counting``): usage per key and task (server/tenancy/usage.py) and the bounded per-key and per-task
  metrics (server/telemetry/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from memvit.memory_core import BASE_TASK

from ..registry import AdapterRegistry, Pin
from ..telemetry.metrics import Metrics
from ..tenancy.usage import UsageMeter
from .answers import Answer
from .device_runner import Item
from .engine_loop import EngineLoop, Job, Result

Images = Tensor | Sequence[Item]  # (n, C, H, W) decoded on the CPU, or one item per image


@dataclass(frozen=True)
class Tenant:
    """Whose request it is: a key's id (``admin``, ``anonymous``) and its weight in the fair queues."""

    id: str = "anonymous"
    weight: float = 1.0


ANONYMOUS = Tenant()


@dataclass(frozen=True)
class Ask:
    """What the request side asks of a runner: ``count`` images' ``tasks`` (checked: each one
    registered when the request arrived; None: every task), for ``tenant``; the top ``top_k`` of each
    (0: none) and, with ``logits``, the logits themselves."""

    count: int
    tasks: list[str] | None
    tenant: Tenant = ANONYMOUS
    top_k: int = 5
    logits: bool = False

    @property
    def adapters(self) -> list[str] | None:
        """The adapters asked for (the base is always computed); None: every one."""
        return None if self.tasks is None else [t for t in self.tasks if t != BASE_TASK]


class Runner(Protocol):
    async def run(self, ask: Ask, images: Awaitable[Images]) -> Answer: ...


def as_items(images: Images, count: int) -> list[Item]:
    items = list(images.unbind(0)) if isinstance(images, Tensor) else list(images)
    if len(items) != count:
        raise ValueError(f"announced {count} images, got {len(items)}")
    return items


def counting(usage: UsageMeter | None, metrics: Metrics | None) -> Callable[[list[tuple[Job, Answer]]], None]:
    """What the engine loop calls with each batch's answers: what the pass computed counted for the
    key that asked (usage: base always, adapters as asked; metrics: per task asked and per key), each
    counter touched once per batch."""

    def count(answered: list[tuple[Job, Answer]]) -> None:
        groups: dict[tuple[str, int], list] = {}  # (key, its tasks' tuple) -> [answer, requests, images]
        for job, answer in answered:  # the requests of a batch asking the same share one tasks tuple
            group = groups.get((job.flow, id(answer.tasks)))
            if group is None:
                group = groups[(job.flow, id(answer.tasks))] = [answer, 0, 0]
            group[1] += 1
            group[2] += job.size
        usage_groups, metric_groups = [], []
        for (key, _), (answer, n, images) in groups.items():
            adapters = [t for t in answer.tasks if t != BASE_TASK]
            usage_groups.append((key, n, images, (BASE_TASK, *adapters)))
            metric_groups.append((key, n, images, answer.tasks, images * len(adapters)))
        if usage is not None:
            usage.record_batch(usage_groups)
        if metrics is not None:
            metrics.answered_batch(metric_groups)

    return count


class LoopSink:
    """Answers from the engine's collector thread to an event loop: one wake-up per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def deliver(self, finished: list[tuple[Job, Result]]) -> None:
        self.loop.call_soon_threadsafe(_settle, finished)


def _settle(finished: list[tuple[Job, Result]]) -> None:
    for job, result in finished:
        future: asyncio.Future = job.context
        if future.done():  # the client went away
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


class LocalRunner:
    """Runs requests on this process's engine loop (server/inference/engine_loop.py)."""

    def __init__(self, registry: AdapterRegistry, engine: EngineLoop) -> None:
        self.registry, self.engine = registry, engine
        self._sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}

    async def run(self, ask: Ask, images: Awaitable[Images]) -> Answer:
        """Routed: these images pay for the adapters asked for, not for every one resident. Their
        adapters are made resident and pinned while the images decode, and stay pinned until the
        batch has run. The batch's snapshot refuses any of them deleted since the request's tasks
        were checked."""
        adapters = ask.adapters
        # Unfiltered (a small registry): every adapter, less any deleted meanwhile or invalid here.
        wanted = self.registry.every_name() if adapters is None else adapters
        loop = asyncio.get_running_loop()
        pinning = _pin(self.registry, wanted, adapters is None, loop)
        self.engine.announce(ask.count)
        try:
            try:
                items = as_items(await images, ask.count)
                await pinning  # resident and pinned before the images are queued
            except BaseException:
                self.engine.withdraw(ask.count)
                raise
            future = loop.create_future()
            job = Job(
                items,
                None if adapters is None else tuple(adapters),
                ask.tasks,
                self._sink(loop),
                top_k=ask.top_k,
                logits=ask.logits,
                flow=ask.tenant.id,
                weight=ask.tenant.weight,
                context=future,
            )
            self.engine.submit(job, announced=True)
            answer = await future
        finally:
            await _unpin(pinning)
        return answer

    def _sink(self, loop: asyncio.AbstractEventLoop) -> LoopSink:
        sink = self._sinks.get(loop)
        if sink is None:
            sink = self._sinks[loop] = LoopSink(loop)
        return sink


def _pin(
    registry: AdapterRegistry, names: Sequence[str], optional: bool, loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Pin]:
    """``names`` pinned (and loaded) as a future: settled at once when every one is resident (the
    usual case: no task, no thread), else by the thread that finished the last load. A pin that
    arrives after the request gave up (its future cancelled) is released."""
    future: asyncio.Future[Pin] = loop.create_future()
    here = threading.get_ident()

    def then(result: Pin | BaseException) -> None:
        if threading.get_ident() == here:
            _settle_pin(future, result)
        else:
            loop.call_soon_threadsafe(_settle_pin, future, result)

    try:
        registry.acquire_then(names, then, optional=optional)
    except Exception as exc:  # raised when awaited: after the images, as before
        future.set_exception(exc)
    return future


def _settle_pin(future: asyncio.Future[Pin], result: Pin | BaseException) -> None:
    if future.done():  # the request gave up meanwhile
        if not isinstance(result, BaseException):
            result.release()
    elif isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


async def _unpin(pinning: asyncio.Future[Pin]) -> None:
    """Release a request's pin once its batch has run (or it failed): the load may still be going."""
    if not pinning.done():
        pinning.cancel()  # the pin, when it comes, is released (_settle_pin)
    with contextlib.suppress(Exception, asyncio.CancelledError):
        (await pinning).release()
