"""The engine loop: requests gathered into batches, and each batch through the device's three stages,
every one on a thread of its own, with no event loop anywhere on the way (docs/design.md §5).

    submit (any thread) -> [batcher + decode] -> [pass] -> [collector] -> each request's sink

- The *batcher* takes the first waiting request, then more, until ``max_batch`` images or
  ``max_wait`` seconds, waiting only for requests on their way (``announce``d) or, optionally, while
  they arrive densely (inference/arrivals.py). The fair queue says which is next (fair_queue.py).
  Each batch reads the live adapter set once (one snapshot answers it) and routes each request by
  what it asks for. It runs on the decode stage's thread, so a batch forms when a decoder is free to
  take it: batches formed ahead split one decoder cycle's requests between batches that each pay the
  fixed costs, with a light key's request behind them all. On a GPU the runner's ``lanes`` are
  decode threads of their own (one forms at a time); ``depth`` batches (3) are in flight, one
  decoded, one computing, one read back; on a CPU one, its stages in turn on the batcher's thread.
- The collector cuts each request's answer (answers.py) and hands a batch's answers to their
  *sinks*, one call per sink per batch (an event loop's, or an API process's connection).

A full queue refuses new work at once (503 + Retry-After) instead of growing, but never a key below
its share of it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from memvit.memory_core import AdapterSet, LiveAdapters

from ..errors import OverloadedError, RetryLaterError
from ..telemetry.metrics import Metrics
from ..telemetry.os_names import os_named
from .answers import Answer
from .arrivals import ArrivalGap
from .device_runner import DeviceRunner
from .fair_queue import ONE_FLOW, FairQueue
from .jobs import Batch, Job, Result, deliver, place, refuse_missing
from .warmup import PassGraphs

log = logging.getLogger(__name__)


class EngineLoop:
    """``fair``: requests are taken by the service each key has received (False: by arrival).
    ``registered(version)``: adapters registered at a snapshot's version, for the answers. ``depth``:
    batches in flight (None: 3 on a GPU, 1 on a CPU); with more, each runner lane a decode thread."""

    def __init__(
        self,
        live: LiveAdapters,
        runner: DeviceRunner,
        *,
        max_batch: int,
        max_wait: float,
        max_queue: int,
        metrics: Metrics,
        fair: bool = True,
        depth: int | None = None,
        registered: Callable[[int], int] = lambda version: 0,
        warm: Callable[[AdapterSet], int] | None = None,
        graphs_beside: bool = True,
        count: Callable[[list[tuple[Job, Answer]]], None] | None = None,
        linger: float = 0.0,
    ) -> None:
        self.live, self.runner = live, runner
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.metrics, self.fair, self.registered = metrics, fair, registered
        # the graphs of a snapshot's passes, and when they are captured (server/inference/warmup.py)
        self.graphs = None if warm is None else PassGraphs(live, warm, beside=graphs_beside)
        self.count = count  # what a batch answered, counted for the keys that asked (usage, metrics)
        self.depth = depth if depth is not None else (3 if runner.cuda else 1)
        self.lanes = len(runner.lanes) if self.depth > 1 else 1  # decode threads
        self._forming = threading.Lock()  # one decode thread forms and routes a batch at a time
        self._queue: FairQueue[Job] = FairQueue()
        self._gap = ArrivalGap(linger)  # a batch's wait for requests not announced (arrivals.py)
        self._lock = threading.Condition()
        self._waiting = 0  # images queued or in a batch not yet answered
        self._expected = 0  # images still decoding that will be queued soon
        self._in_flight = 0  # batches formed and not yet answered
        self._running = False
        self._threads: list[threading.Thread] = []
        self._stages = [queue.SimpleQueue() for _ in range(2)]  # to pass, to collect

    # -- from any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Capture the graphs the passes will replay (before any stage runs), then start the stages."""
        if self.graphs is not None:
            self.graphs.start()
        self._running = True
        # names of 15 bytes at most (the kernel's): engine-batcher, engine-batcher1, ...
        work = [(self._batcher, f"engine-batcher{lane or ''}", (lane,)) for lane in range(self.lanes)]
        if self.depth > 1:  # else one batch in flight: its stages in turn, on the batcher's thread
            work += [(self._passing, "engine-pass", ()), (self._collecting, "engine-collect", ())]
        self._threads = [
            threading.Thread(target=os_named(n, w), name=n, args=a, daemon=True) for w, n, a in work
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Batches already formed finish and answer their requests; requests still queued are refused
        (503, Retry-After)."""
        with self._lock:
            self._running = False
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        if self.graphs is not None:
            self.graphs.stop()
        left = []
        with self._lock:
            while self._queue.peek() is not None:
                left.append(self._queue.pop())
        deliver([(job, RetryLaterError("the server is stopping; retry shortly")) for job in left])

    def announce(self, n: int) -> None:
        """``n`` images are decoding and will be submitted (or ``withdraw``n): a forming batch waits."""
        with self._lock:
            self._expected += n

    def withdraw(self, n: int) -> None:
        with self._lock:
            self._expected -= n
            self._lock.notify_all()

    def submit(self, job: Job, *, announced: bool = False) -> None:
        """Queue ``job`` (its answer goes to ``job.sink``); ``announced``: its images were announced,
        and are no longer on their way once it is queued. Raises ``OverloadedError`` at once when the
        queue is full (unless its key is below its share of it)."""
        n = job.size
        flow = job.flow if self.fair else ONE_FLOW
        with self._lock:
            if announced:
                self._expected -= n
            room = self.max_queue - (self._waiting - self._queue.waiting)
            if not self._queue.admits(flow, n, room, job.weight):
                self._lock.notify_all()
                self.metrics.rejected.inc()
                raise OverloadedError(
                    f"server busy: {self._waiting} images already queued (limit {self.max_queue}); "
                    "retry shortly"
                )
            self._waiting += n
            job.queued = time.perf_counter()
            self._gap.arrived(job.queued)
            self._queue.put(flow, job, n, job.weight)
            self._lock.notify_all()

    # -- the batcher -----------------------------------------------------------------------------------
    def _batcher(self, lane: int) -> None:
        """Forms a batch, routes it and decodes it with the runner's ``lane`` (a GPU's decode queues on
        its prep stream), then the next: so a batch forms only once a decoder is free for it (see the
        module's docstring). Decode threads form one at a time; each decodes on its own."""
        while True:
            with self._forming:
                batch = self._form()
                if batch is None:
                    break
                if self.graphs is not None and self.graphs.stale():  # not captured on growth
                    with self._lock:  # (warmup.py): again with every other stage idle; the other
                        while self._in_flight > 1:  # decode threads finish theirs, then wait here
                            self._lock.wait()
                    self.graphs.capture()
                try:
                    self._route(batch)
                except Exception as exc:  # never leave a client hanging
                    log.exception("routing a batch failed")
                    self._finish(batch, [(job, exc) for job in batch.jobs])
                    continue
            if self.depth == 1:
                self._run_inline(batch)
            elif self._decode(batch, lane):
                self._stages[0].put(batch)
        self._stages[0].put(None)  # the pass thread (if any) stops once every decode thread has

    def _form(self) -> Batch | None:
        queue_ = self._queue
        with self._lock:
            while self._running and (queue_.peek() is None or self._in_flight >= self.depth):
                self._lock.wait()
            if not self._running:
                return None
            jobs = [queue_.pop()]
            size = jobs[0].size
            deadline = time.monotonic() + self.max_wait
            while size < self.max_batch:
                head = queue_.peek()
                if head is None:
                    remaining = deadline - time.monotonic()
                    if self._expected > 0 and remaining > 0:  # announced: on its way
                        self._lock.wait(remaining)
                        continue
                    linger = self._gap.wait(remaining)  # none announced; one may come (arrivals.py)
                    if linger <= 0 or not self._lock.wait(linger) or queue_.peek() is None:
                        break
                    continue
                if size + head > self.max_batch:  # it starts a later batch (the next, unless another
                    break  # key is owed more by then)
                jobs.append(queue_.pop())
                size += head
            self._in_flight += 1
            waiting = self._waiting
        self.metrics.queue_depth.set(waiting)  # once a batch, not once a request
        return Batch(jobs, size)

    def _route(self, batch: Batch) -> None:
        """One snapshot for the whole batch; its jobs routed against it (jobs.py), the refused answered
        first (whatever happens to the rest)."""
        refused = refuse_missing(batch, self.live.current)
        if refused:
            deliver(refused)
        place(batch)

    # -- the stages ------------------------------------------------------------------------------------
    # Each step runs a batch through its stage; False: the batch is done with (answered or failed).
    def _decode(self, batch: Batch, lane: int = 0) -> bool:
        if not batch.jobs:
            self._finish(batch, [])
            return False
        batch.started = time.perf_counter()
        self.metrics.batch_size.observe(sum(job.size for job in batch.jobs))
        return self._step(
            batch, lambda: self.runner.decode([item for job in batch.jobs for item in job.items], lane)
        )

    def _launch(self, batch: Batch) -> bool:
        with contextlib.nullcontext() if self.graphs is None else self.graphs.serving():  # warmup.py
            return self._step(
                batch, lambda: self.runner.launch(batch.stage, batch.adapter_set, batch.tasks, batch.wants)
            )

    def _step(self, batch: Batch, work: Callable[[], Any]) -> bool:
        try:
            batch.stage = work()
        except Exception as exc:  # never leave a client hanging
            log.exception("fused pass failed")
            self._finish(batch, [(job, exc) for job in batch.jobs])
            return False
        return True

    def _collect(self, batch: Batch) -> None:
        if not self._step(batch, lambda: self.runner.collect(batch.stage)):
            return
        ran = batch.stage
        self.metrics.fused_pass_seconds.observe(time.perf_counter() - batch.started)
        version = batch.adapter_set.version
        registered = self.registered(version)
        finished: list[tuple[Job, Result]] = []
        for job, want in zip(batch.jobs, batch.wants, strict=True):
            try:
                answer: Result = ran.cut(want, job.tasks, version, registered)
                answer.stages.update(queue=batch.started - job.queued, **ran.seconds)
            except Exception as exc:  # its image failed to decode, or did not fit on the device
                answer = exc
            finished.append((job, answer))
        if self.count is not None:
            try:
                self.count([(job, a) for job, a in finished if isinstance(a, Answer)])
            except Exception:  # counting must never cost an answer
                log.exception("counting a batch's answers failed")
        self._finish(batch, finished)

    def _run_inline(self, batch: Batch) -> None:
        """One batch in flight (a CPU): its stages in turn, on the batcher's thread (no hand-offs)."""
        if self._decode(batch) and self._launch(batch):
            self._collect(batch)

    def _passing(self) -> None:
        inbox, outbox = self._stages
        running = self.lanes  # decode threads still forming batches
        while running:
            batch = inbox.get()
            if batch is None:
                running -= 1
            elif self._launch(batch):
                outbox.put(batch)
        outbox.put(None)

    def _collecting(self) -> None:
        while (batch := self._stages[1].get()) is not None:
            self._collect(batch)

    def _finish(self, batch: Batch, finished: list[tuple[Job, Result]]) -> None:
        deliver(finished)
        with self._lock:
            self._waiting -= batch.size
            self._in_flight -= 1
            self._lock.notify_all()
        self.metrics.queue_depth.set(self._waiting)
