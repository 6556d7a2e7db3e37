"""Dynamic batching: concurrent requests gathered into one fused pass, run off the event loop.

A request's images wait in a queue; one gatherer task takes the first waiting request, then more
until ``max_batch`` images or ``max_wait`` seconds, and hands the batch to a single inference
thread. Which request is next is the fair queue's choice (server/fair_queue.py): the key that has
received the least service, by weight, so one key's backlog never holds up another's requests.
It only waits for requests that are on their way (announced by ``run`` while their images decode):
a lone request runs at once instead of sitting out ``max_wait`` for nobody. Each batch reads the
live adapter set once, so every request in it is answered by that one snapshot. A full queue
refuses new work at once (503 + Retry-After) instead of growing, but never a key below its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from memvit.memory_core import AdapterSet, FusedOutput, LiveAdapters

from .errors import OverloadedError
from .fair_queue import ONE_FLOW, FairQueue
from .metrics import Metrics
from .tasks import unknown_tasks_error

log = logging.getLogger(__name__)


@dataclass
class _Job:
    images: Tensor  # (n, C, H, W)
    future: asyncio.Future[FusedOutput]
    tasks: frozenset[str] | None = None  # adapters its images ask for; None: every one resident


class DynamicBatcher:
    """``fair``: requests are taken by the service each key has received (False: by arrival)."""

    def __init__(
        self,
        live: LiveAdapters,
        *,
        max_batch: int,
        max_wait: float,
        max_queue: int,
        metrics: Metrics,
        fair: bool = True,
    ) -> None:
        self.live = live
        self.engine = live.engine
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.metrics = metrics
        self.fair = fair
        self._queue: FairQueue[_Job] = FairQueue()
        self._queued = asyncio.Event()  # set while a job waits in the queue
        self._waiting = 0  # images queued or in the pass running
        self._expected = 0  # images still decoding that will be queued soon
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused-pass")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._gather_forever(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def run(
        self,
        n: int,
        images: Awaitable[Tensor],
        tasks: Collection[str] | None = None,
        *,
        flow: str = ONE_FLOW,
        weight: float = 1.0,
    ) -> FusedOutput:
        """Announce ``n`` images, await them (``images`` decodes them), then queue them for the next
        pass and return their share of its output.

        ``tasks``: the adapters these images ask for (None: every one loaded). Requests with
        different tasks share one pass, routed so each image pays only for what it asks
        (memory_core/routing.py); an adapter the batch's snapshot no longer has fails this request
        alone, with ``UnknownTaskError``. ``flow``: whose request it is (a key's id), and ``weight``
        that key's share of the passes while others wait too.

        While ``images`` is awaited a forming batch may wait for these ``n`` images. Leaving that
        announcement and queueing the job happen with no await in between, so the gatherer always
        sees one or the other: never a moment where these images are neither expected nor queued.
        """
        self._expected += n
        try:
            batch = await images  # (n, C, H, W)
        finally:
            self._expected -= n
        wanted = None if tasks is None else frozenset(tasks)
        # _enqueue queues synchronously, then we wait on it
        return await self._enqueue(batch, wanted, flow if self.fair else ONE_FLOW, weight)

    def _enqueue(
        self, images: Tensor, tasks: frozenset[str] | None, flow: str, weight: float
    ) -> asyncio.Future[FusedOutput]:
        n = images.shape[0]
        # The limit counts the pass running too; a key below its share of it is let in regardless, so
        # another key's backlog cannot lock it out (the fair queue's rule).
        if not self._queue.admits(flow, n, self.max_queue - (self._waiting - self._queue.waiting), weight):
            self.metrics.rejected.inc()
            raise OverloadedError(
                f"server busy: {self._waiting} images already queued (limit {self.max_queue}); retry shortly"
            )
        future = asyncio.get_running_loop().create_future()
        self._waiting += n
        self.metrics.queue_depth.set(self._waiting)
        self._queue.put(flow, _Job(images, future, tasks), n, weight)
        self._queued.set()
        return future

    def _pop(self) -> _Job:
        job = self._queue.pop()
        if self._queue.peek() is None:
            self._queued.clear()
        return job

    async def _gather_forever(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            await self._queued.wait()
            batch = [self._pop()]
            size = batch[0].images.shape[0]
            deadline = loop.time() + self.max_wait
            while size < self.max_batch:
                head = queue.peek()
                if head is None:
                    remaining = deadline - loop.time()
                    if remaining <= 0 or self._expected == 0:  # nothing is on its way
                        break
                    try:
                        await asyncio.wait_for(self._queued.wait(), remaining)
                    except TimeoutError:
                        break
                    continue
                if size + head > self.max_batch:  # it starts a later batch (the next, unless another
                    break  # key is owed more by then)
                batch.append(self._pop())
                size += head
            await self._run(batch, size, loop)

    async def _run(self, batch: list[_Job], size: int, loop: asyncio.AbstractEventLoop) -> None:
        adapter_set = self.live.current  # one snapshot for the whole batch
        try:
            batch, tasks = self._route(batch, adapter_set)
            if batch:
                images = torch.cat([job.images for job in batch]) if len(batch) > 1 else batch[0].images
                self.metrics.batch_size.observe(images.shape[0])
                started = time.perf_counter()
                out = await loop.run_in_executor(self._executor, self._forward, images, adapter_set, tasks)
                self.metrics.fused_pass_seconds.observe(time.perf_counter() - started)
        except Exception as exc:  # never leave a client hanging
            log.exception("fused pass failed")
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self._waiting -= size
            self.metrics.queue_depth.set(self._waiting)
        start = 0
        for job in batch:
            n = job.images.shape[0]
            if not job.future.done():  # the client may have gone away
                job.future.set_result(out[start : start + n])
            start += n

    @staticmethod
    def _route(batch: list[_Job], adapter_set: AdapterSet) -> tuple[list[_Job], list[tuple[str, ...]] | None]:
        """The jobs the snapshot can answer, and each image's adapters (None: all, for every image).

        A job asking for an adapter the snapshot lacks (removed while it waited) fails alone.
        """
        runnable = []
        for job in batch:
            unknown = sorted(job.tasks - set(adapter_set.names)) if job.tasks is not None else []
            if unknown:
                if not job.future.done():
                    why = ": removed while the request waited"
                    job.future.set_exception(
                        unknown_tasks_error(unknown, adapter_set.names, len(adapter_set), why)
                    )
                continue
            runnable.append(job)
        if all(job.tasks is None for job in runnable):
            return runnable, None  # every image asks for everything: the unrouted pass
        every = adapter_set.names
        tasks = [
            every if job.tasks is None else tuple(n for n in every if n in job.tasks)
            for job in runnable
            for _ in range(job.images.shape[0])
        ]
        return runnable, tasks

    def _forward(
        self, images: Tensor, adapter_set: AdapterSet, tasks: list[tuple[str, ...]] | None = None
    ) -> FusedOutput:
        with torch.inference_mode():
            out = self.engine(images.to(self.engine.device), adapter_set, tasks=tasks)
        # Hand back float32 CPU tensors: the event loop only slices them and picks the top k.
        return out.to("cpu", torch.float32)
