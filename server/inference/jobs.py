"""What the engine loop carries: a request's ``Job``, its ``Result``, the ``Sink`` that takes it, a
``Batch`` on its way through the stages; and the two steps that touch every job of a batch, routing
it against the batch's snapshot and delivering its results (server/inference/engine_loop.py runs them).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from memvit.memory_core import AdapterSet, TaskIndex

from .answers import Answer, Want
from .device_runner import Item
from .fair_queue import ONE_FLOW
from .tasks import unknown_tasks_error

log = logging.getLogger("memvit.server.inference.engine_loop")  # the engine loop's own
Result = Answer | BaseException


class Sink(Protocol):
    """Where finished requests go: ``deliver`` is called once per batch with its requests here."""

    def deliver(self, finished: list[tuple[Job, Result]]) -> None: ...


@dataclass(eq=False, slots=True)
class Job:
    """One request's images, queued for a pass."""

    items: Sequence[Item]  # its n images: decoded (C, H, W), or JPEGs for the device decoder
    adapters: tuple[str, ...] | None  # the adapters its images ask for (None: every one resident)
    tasks: Sequence[str] | None  # what to answer, in order (None: the base and every adapter computed)
    sink: Sink
    top_k: int = 5
    logits: bool = False
    flow: str = ONE_FLOW  # whose request (a key's id) and its weight in the fair queue
    weight: float = 1.0
    context: Any = None  # the submitter's own (its future, its call): the engine never reads it
    queued: float = 0.0  # perf_counter when it was queued
    seconds: dict[str, float] = field(default_factory=dict)  # its stages: queue, decode, copy, pass
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.items)


@dataclass
class Batch:
    jobs: list[Job]
    size: int  # images counted against the queue (every job's, the refused ones too)
    adapter_set: AdapterSet | None = None
    tasks: TaskIndex | None = None  # per image, the set positions it asks for (None: every one)
    wants: list[Want] = field(default_factory=list)
    stage: Any = None  # what the last stage handed on
    started: float = 0.0


def refuse_missing(batch: Batch, adapter_set: AdapterSet) -> list[tuple[Job, Result]]:
    """Route ``batch`` against ``adapter_set`` (its one snapshot): the jobs asking for an adapter the
    snapshot lacks (removed while they waited) are taken out and returned with their errors, each
    failing alone."""
    batch.adapter_set = adapter_set
    runnable, refused = [], []
    for job in batch.jobs:
        gone = [] if job.adapters is None else [a for a in job.adapters if a not in adapter_set]
        if gone:
            why = ": removed while the request waited"
            error = unknown_tasks_error(sorted(gone), adapter_set.names, len(adapter_set), why)
            refused.append((job, error))
        else:
            runnable.append(job)
    batch.jobs = runnable
    return refused


def place(batch: Batch) -> None:
    """Each image's adapters (as positions in the snapshot) and each job's images in the batch. Costs
    each job the adapters it asks for: never a pass over every resident name."""
    adapter_set, runnable = batch.adapter_set, batch.jobs
    assert adapter_set is not None
    if any(job.adapters is not None for job in runnable):  # routed: each job's adapters, as positions
        parts = [
            TaskIndex.every(adapter_set, job.size)
            if job.adapters is None
            else TaskIndex.uniform(adapter_set, job.adapters, job.size)
            for job in runnable
        ]
        batch.tasks = TaskIndex.join(parts)
    start = 0
    for job in runnable:
        batch.wants.append(Want(start, start + job.size, job.top_k, job.logits))
        start += job.size


def deliver(finished: list[tuple[Job, Result]]) -> None:
    """One call per sink, with all of its requests."""
    by_sink: dict[int, list[tuple[Job, Result]]] = defaultdict(list)
    sinks = {}
    for job, result in finished:
        by_sink[id(job.sink)].append((job, result))
        sinks[id(job.sink)] = job.sink
    for key, results in by_sink.items():
        try:
            sinks[key].deliver(results)
        except Exception:
            log.exception("delivering answers failed")
