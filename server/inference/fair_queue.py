"""The fair queues: work taken by the service each key has received, not by arrival.

A first-come queue lets a key that sends 30 requests at once take every fused pass from a key that
sends one. This queue keeps one line per *flow* (a key's id; the anonymous caller and the admin
token are flows too) and hands out jobs in the manner of the Virtual Token Counter (Sheng et al.,
*Fairness in Serving Large Language Models*, OSDI 2024):

- each flow has a counter of the service it has received, in images divided by its weight;
- the next job is the head of the waiting flow with the smallest counter (ties: the one that has
  waited longest), and taking it adds its images / weight to that flow's counter;
- a flow that starts waiting again has its counter lifted to the smallest counter among the flows
  waiting (or, with none waiting, to the counter of the flow served last), so time spent idle is not
  banked as credit with which to starve the others later.

It is work-conserving: a job is handed out whenever one waits, so a lone flow gets every pass. Over
any stretch where several flows wait, each one's images differ from its weight's share by at most
one job's worth per flow (the paper's bound, with a job's images for a request's tokens).

Bounded: ``admits`` refuses a job when the images waiting would pass the limit, unless the flow is
below its weight's share of that limit, so a key that fills the queue cannot lock the others out
(the total stays below twice the limit). ``FairQueue`` is not thread-safe: its owner serialises it
(the batcher: the event loop; ``FairPool``: a lock).

Two users: the batcher, which fills fused passes from a ``FairQueue``, and the decoders, whose
thread pool runs each key's images in turn through a ``FairPool``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

J = TypeVar("J")

ONE_FLOW = "*"  # fairness off: every job in one line, first come first served


@dataclass
class _Flow(Generic[J]):
    jobs: deque[tuple[int, J, int]] = field(default_factory=deque)  # (arrival, job, images)
    weight: float = 1.0
    waiting: int = 0  # images in ``jobs``
    counter: float = 0.0  # images served / weight


class FairQueue(Generic[J]):
    """Jobs in per-flow lines, taken by the least service received (see the module's doc)."""

    def __init__(self) -> None:
        self._flows: dict[str, _Flow[J]] = {}
        self._active: dict[str, _Flow[J]] = {}  # flows with jobs waiting
        self._arrivals = itertools.count()
        self._last_served = 0.0  # the counter of the flow served last: where a returning flow starts
        self.waiting = 0  # images waiting, every flow

    def admits(self, flow: str, images: int, limit: int, weight: float = 1.0) -> bool:
        """May ``flow`` queue ``images`` more? Yes while the total stays within ``limit``, and always
        while the flow stays within its weight's share of ``limit`` among the flows waiting."""
        if self.waiting + images <= limit:
            return True
        active = self._active
        total = sum(f.weight for name, f in active.items() if name != flow) + weight
        mine = active[flow].waiting if flow in active else 0
        return mine + images <= limit * weight / total

    def _line(self, flow: str, weight: float) -> _Flow[J]:
        line = self._flows.get(flow)
        if line is None:
            line = self._flows[flow] = _Flow()
        line.weight = weight  # the keys file may have changed it since the flow's last job
        if not line.jobs:  # the flow is not waiting: lift it to the others (no banked idle time)
            floor = min((f.counter for f in self._active.values()), default=self._last_served)
            line.counter = max(line.counter, floor)
        return line

    def put(self, flow: str, job: J, images: int, weight: float = 1.0) -> None:
        """Queue ``job`` (``images`` of work) for ``flow``, whose weight is ``weight`` (> 0)."""
        line = self._line(flow, weight)
        if not line.jobs:
            self._active[flow] = line
        line.jobs.append((next(self._arrivals), job, images))
        line.waiting += images
        self.waiting += images

    def _next(self) -> tuple[str, _Flow[J]] | None:
        if not self._active:
            return None
        return min(self._active.items(), key=lambda item: (item[1].counter, item[1].jobs[0][0]))

    def peek(self) -> int | None:
        """The images of the job ``pop`` would return, or None when nothing waits."""
        chosen = self._next()
        return None if chosen is None else chosen[1].jobs[0][2]

    def charge(self, flow: str, images: float, weight: float = 1.0) -> None:
        """Count service ``flow`` received outside the queue (taken without waiting, or a correction
        once a request's size is known): its counter grows as if a job of ``images`` was popped."""
        line = self._line(flow, weight)
        line.counter += images / weight
        self._last_served = line.counter

    def pop(self) -> J:
        """The next job (IndexError when nothing waits); its flow is charged for its images."""
        chosen = self._next()
        if chosen is None:
            raise IndexError("pop from an empty FairQueue")
        name, line = chosen
        _, job, images = line.jobs.popleft()
        line.waiting -= images
        self.waiting -= images
        line.counter += images / line.weight
        self._last_served = line.counter
        if not line.jobs:
            del self._active[name]
        return job

    def counters(self) -> dict[str, float]:
        """Each flow's service received, in images / weight (for tests and the curious)."""
        return {name: flow.counter for name, flow in self._flows.items()}


class FairPool:
    """An executor's calls run in the order of a ``FairQueue``, chosen by the thread that runs them.

    A thread pool serves its calls first come: one key's 32 photos in flight would queue another
    key's one photo behind ~32 decodes. Here each call waits in its flow's line, and every submission
    to the executor runs "the next call in the fair order", picked when a thread is free: the order
    is the fair queue's, and a free thread never waits for the event loop to hand it work. A call
    whose caller has gone away (its future cancelled) is skipped.
    """

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._queue: FairQueue[tuple[Callable[..., Any], tuple, asyncio.Future, asyncio.AbstractEventLoop]]
        self._queue = FairQueue()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Calls submitted and not yet started."""
        with self._lock:
            return self._queue.waiting

    def submit(self, flow: str, weight: float, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` in ``flow``'s turn (one unit of its service); its result as an asyncio future."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._queue.put(flow, (fn, args, future, loop), 1, weight)
        self.executor.submit(self._run_next)
        return future

    def _run_next(self) -> None:
        with self._lock:
            fn, args, future, loop = self._queue.pop()
        if future.cancelled():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller, as run_in_executor would
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
