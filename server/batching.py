"""Dynamic batching: concurrent requests gathered into one fused pass, run off the event loop.

A request's images wait in a queue; one gatherer task takes the first waiting request, then more
until ``max_batch`` images or ``max_wait`` seconds, and hands the batch to a single inference
thread. It only waits for requests that are on their way (announced by ``run`` while their images
decode): a lone request runs at once instead of sitting out ``max_wait`` for nobody. Each batch
reads the live adapter set once, so every request in it is answered by that one snapshot.
A full queue refuses new work at once (503 + Retry-After) instead of growing.
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
from .metrics import Metrics
from .tasks import unknown_tasks_error

log = logging.getLogger(__name__)


@dataclass
class _Job:
    images: Tensor  # (n, C, H, W)
    future: asyncio.Future[FusedOutput]
    tasks: frozenset[str] | None = None  # adapters its images ask for; None: every one resident


class DynamicBatcher:
    def __init__(
        self, live: LiveAdapters, *, max_batch: int, max_wait: float, max_queue: int, metrics: Metrics
    ) -> None:
        self.live = live
        self.engine = live.engine
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.metrics = metrics
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._waiting = 0  # images queued, not yet in a pass
        self._carry: _Job | None = None  # a job that did not fit the previous batch
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
        self, n: int, images: Awaitable[Tensor], tasks: Collection[str] | None = None
    ) -> FusedOutput:
        """Announce ``n`` images, await them (``images`` decodes them), then queue them for the next
        pass and return their share of its output.

        ``tasks``: the adapters these images ask for (None: every one loaded). Requests with
        different tasks share one pass, routed so each image pays only for what it asks
        (memory_core/routing.py); an adapter the batch's snapshot no longer has fails this request
        alone, with ``UnknownTaskError``.

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
        return await self._enqueue(batch, wanted)  # _enqueue queues synchronously, then we wait on it

    def _enqueue(self, images: Tensor, tasks: frozenset[str] | None = None) -> asyncio.Future[FusedOutput]:
        n = images.shape[0]
        if self._waiting + n > self.max_queue:
            self.metrics.rejected.inc()
            raise OverloadedError(
                f"server busy: {self._waiting} images already queued (limit {self.max_queue}); retry shortly"
            )
        future = asyncio.get_running_loop().create_future()
        self._waiting += n
        self.metrics.queue_depth.set(self._waiting)
        self._queue.put_nowait(_Job(images, future, tasks))
        return future

    async def _gather_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [self._carry or await self._queue.get()]
            self._carry = None
            size = batch[0].images.shape[0]
            deadline = loop.time() + self.max_wait
            while size < self.max_batch:
                try:
                    job = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0 or self._expected == 0:  # nothing is on its way
                        break
                    try:
                        job = await asyncio.wait_for(self._queue.get(), remaining)
                    except TimeoutError:
                        break
                if size + job.images.shape[0] > self.max_batch:
                    self._carry = job
                    break
                batch.append(job)
                size += job.images.shape[0]
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
