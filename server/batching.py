"""Dynamic batching: concurrent requests gathered into one fused pass, run off the event loop.

A request's images wait in a queue; one gatherer task takes the first waiting request, then more
until ``max_batch`` images or ``max_wait`` seconds, and hands the batch to a single inference
thread, which launches it on the model's device (server/device_runner.py: JPEGs decoded there,
other images copied through pinned memory, the pass). On a GPU the launch returns before the device
has finished, and a second thread collects the answers: two batches are in flight, so the host
prepares one while the device computes the other. On a CPU a launch is the whole pass.
Which request is next is the fair queue's choice (server/fair_queue.py): the key that has
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
from collections.abc import Awaitable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from torch import Tensor

from memvit.memory_core import AdapterSet, FusedOutput, LiveAdapters

from .device_decode import DeviceDecoder
from .device_runner import DeviceRunner, Item, Launched
from .errors import OverloadedError, ServiceError
from .fair_queue import ONE_FLOW, FairQueue
from .metrics import Metrics
from .stages import StageTimes
from .tasks import unknown_tasks_error

log = logging.getLogger(__name__)


@dataclass
class _Job:
    items: Sequence[Item]  # its n images: decoded (C, H, W), or JPEGs for the device decoder
    future: asyncio.Future[FusedOutput]
    tasks: frozenset[str] | None = None  # adapters its images ask for; None: every one resident
    stages: StageTimes | None = None  # its request's stage times (server/stages.py)
    queued: float = 0.0  # perf_counter when it was queued

    @property
    def size(self) -> int:
        return len(self.items)


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
        decoder: DeviceDecoder | None = None,
    ) -> None:
        self.live = live
        self.engine = live.engine
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.metrics = metrics
        self.fair = fair
        self.runner = DeviceRunner(self.engine, decoder)
        # Two batches in flight on a GPU (one computing, one being prepared); on a CPU the launch is
        # the pass, so a second one would only hold images back from a batch still forming.
        self._in_flight = asyncio.Semaphore(2 if self.runner.cuda else 1)
        self._queue: FairQueue[_Job] = FairQueue()
        self._queued = asyncio.Event()  # set while a job waits in the queue
        self._waiting = 0  # images queued or in the pass running
        self._expected = 0  # images still decoding that will be queued soon
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused-pass")
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fused-collect")
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._gather_forever(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._running:  # batches already launched finish and answer their requests
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._collector.shutdown(wait=True, cancel_futures=True)

    async def run(
        self,
        n: int,
        images: Awaitable[Tensor | Sequence[Item]],
        tasks: Collection[str] | None = None,
        *,
        flow: str = ONE_FLOW,
        weight: float = 1.0,
        stages: StageTimes | None = None,
    ) -> FusedOutput:
        """Announce ``n`` images, await them (``images`` decodes them: a (n, C, H, W) tensor, or one
        item per image), then queue them for the next pass and return their share of its output,
        float32 on the host. ``stages``: the request's stage times, which get its queue wait and its
        batch's copy, device decode and pass.

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
            batch = await images
        finally:
            self._expected -= n
        items = list(batch.unbind(0)) if isinstance(batch, Tensor) else list(batch)
        if len(items) != n:
            raise ValueError(f"announced {n} images, got {len(items)}")
        wanted = None if tasks is None else frozenset(tasks)
        job = _Job(items, asyncio.get_running_loop().create_future(), wanted, stages)
        # _enqueue queues synchronously, then we wait on it
        return await self._enqueue(job, flow if self.fair else ONE_FLOW, weight)

    def _enqueue(self, job: _Job, flow: str, weight: float) -> asyncio.Future[FusedOutput]:
        n = job.size
        # The limit counts the pass running too; a key below its share of it is let in regardless, so
        # another key's backlog cannot lock it out (the fair queue's rule).
        if not self._queue.admits(flow, n, self.max_queue - (self._waiting - self._queue.waiting), weight):
            self.metrics.rejected.inc()
            raise OverloadedError(
                f"server busy: {self._waiting} images already queued (limit {self.max_queue}); retry shortly"
            )
        self._waiting += n
        self.metrics.queue_depth.set(self._waiting)
        job.queued = time.perf_counter()
        self._queue.put(flow, job, n, weight)
        self._queued.set()
        return job.future

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
            await self._in_flight.acquire()  # released once the batch's answers are back
            batch = [self._pop()]
            size = batch[0].size
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
            await self._launch_batch(batch, size, loop)

    async def _launch_batch(self, batch: list[_Job], size: int, loop: asyncio.AbstractEventLoop) -> None:
        """Launch one batch on the device; a task answers it once it has run."""
        adapter_set = self.live.current  # one snapshot for the whole batch
        try:
            batch, tasks = self._route(batch, adapter_set)
            launched = None
            started = time.perf_counter()
            if batch:
                items = [item for job in batch for item in job.items]
                self.metrics.batch_size.observe(len(items))
                for job in batch:
                    if job.stages is not None:
                        job.stages.add("queue", started - job.queued)
                launched = await loop.run_in_executor(self._executor, self._launch, items, adapter_set, tasks)
        except Exception as exc:  # never leave a client hanging
            log.exception("fused pass failed")
            self._fail(batch, exc)
            self._finished(size)
            return
        answering = asyncio.create_task(self._answer(batch, size, launched, started, loop))
        self._running.add(answering)
        answering.add_done_callback(self._running.discard)

    def _launch(self, items: list[Item], adapter_set: AdapterSet, tasks: list | None) -> Launched:
        """The inference thread's part of a batch (a seam for tests)."""
        return self.runner.launch(items, adapter_set, tasks)

    async def _answer(
        self,
        batch: list[_Job],
        size: int,
        launched: Launched | None,
        started: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Wait for a launched batch (on the collector thread when the device runs it apart) and
        answer each request from its images' share: its logits, or what failed them alone."""
        try:
            if launched is None:
                return
            if launched.done is None:  # a CPU launch has run already
                ran = self.runner.collect(launched)
            else:
                ran = await loop.run_in_executor(self._collector, self.runner.collect, launched)
            self.metrics.fused_pass_seconds.observe(time.perf_counter() - started)
        except Exception as exc:  # never leave a client hanging
            log.exception("fused pass failed")
            self._fail(batch, exc)
            return
        finally:
            self._finished(size)
        now = time.perf_counter()
        start = 0
        for job in batch:
            if job.stages is not None:
                for stage, seconds in ran.seconds.items():
                    job.stages.add(stage, seconds)
                job.stages.answered = now
            if not job.future.done():  # the client may have gone away
                try:
                    job.future.set_result(ran.slice(start, start + job.size))
                except ServiceError as exc:  # its image failed to decode, or did not fit on the device
                    job.future.set_exception(exc)
            start += job.size

    def _finished(self, size: int) -> None:
        self._waiting -= size
        self.metrics.queue_depth.set(self._waiting)
        self._in_flight.release()

    @staticmethod
    def _fail(batch: list[_Job], exc: Exception) -> None:
        for job in batch:
            if not job.future.done():
                job.future.set_exception(exc)

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
            for _ in range(job.size)
        ]
        return runnable, tasks
