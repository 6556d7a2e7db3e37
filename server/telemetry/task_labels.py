"""Which tasks get their own Prometheus series: a bounded few, whatever the registry holds.

A label per adapter ever asked for is one series per adapter: at 100,000 registered adapters the
scrape itself becomes the load, and Prometheus' guidance is never to label by an unbounded value.
So a per-task series exists only for

- ``base``;
- the adapters named in ``MEMVIT_METRICS_TASKS`` (a list the operator bounds);
- the ``MEMVIT_METRICS_TOP_TASKS`` most asked (N), chosen again at each scrape (until N tasks have
  been asked, each gets a series from its first request: a small registry is counted exactly);

and every other task is counted under ``other``. At most 2 + |list| + N series per metric.

"Most asked" is counted in a bounded table (``TopTasks``): exact for tasks that stay in it, and
pruned to its most asked half whenever it doubles, so memory stays bounded too while a task asked
often enough is never pruned. A task with a series keeps it until another is asked 10% more often
(so two tasks level at rank N do not swap at every scrape); a task that loses its series takes its
counts with it, and one that gains a series starts it at zero (its earlier requests stay in
``other``). Task names are never ``other``'s: an adapter named ``other`` is counted under it.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Iterable

from memvit.memory_core import BASE_TASK

OTHER = "other"


class TopTasks:
    """Requests per task, for the ``capacity`` most asked (and up to as many newer ones)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.counts: dict[str, int] = {}

    def add(self, task: str, n: int = 1) -> None:
        self.counts[task] = self.counts.get(task, 0) + n
        if len(self.counts) > 2 * self.capacity:  # amortised: one prune per `capacity` new tasks
            kept = heapq.nlargest(self.capacity, self.counts.items(), key=lambda item: item[1])
            self.counts = dict(kept)

    def top(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` most asked and their counts, most first (ties: by name, so the choice is stable)."""
        return heapq.nsmallest(n, self.counts.items(), key=lambda item: (-item[1], item[0]))


class TaskLabels:
    """The label each task is counted under (see the module's doc)."""

    def __init__(self, named: Iterable[str] = (), top: int = 20) -> None:
        self.named = frozenset(named) - {OTHER}
        self.top = top
        self._asked = TopTasks(max(16 * top, 1024))
        self._chosen: set[str] = set()  # the top tasks with a series now
        self._lock = threading.Lock()

    def label(self, task: str) -> str:
        if task == BASE_TASK or task in self.named or task in self._chosen:
            return task
        if task != OTHER and len(self._chosen) < self.top:
            with self._lock:  # a free slot: this task is among the N most asked so far
                if len(self._chosen) < self.top:
                    self._chosen.add(task)
                    return task
        return OTHER

    def asked(self, tasks: Iterable[str]) -> None:
        """Count one request for each of ``tasks`` (adapters; base needs no ranking)."""
        with self._lock:
            for task in tasks:
                if task != BASE_TASK and task not in self.named and task != OTHER:
                    self._asked.add(task)

    def asked_counts(self, counts: dict[str, int]) -> None:
        """``asked`` for many requests: ``counts[task]`` requests asked for ``task``."""
        with self._lock:
            for task, n in counts.items():
                if task != BASE_TASK and task not in self.named and task != OTHER:
                    self._asked.add(task, n)

    def refresh(self, drop: Callable[[str], None]) -> None:
        """Choose the top tasks again; ``drop(task)`` removes the series of each that lost its own."""
        with self._lock:
            if self.top <= 0:
                return
            # Incumbents score 10% over their count: a newcomer must be asked clearly more to take a slot.
            ranked = self._asked.top(2 * self.top)
            chosen = self._chosen
            scored = sorted(ranked, key=lambda item: (-item[1] * (1.1 if item[0] in chosen else 1), item[0]))
            kept = {task for task, _ in scored[: self.top]}
            gone, self._chosen = self._chosen - kept, kept
        for task in gone:
            drop(task)
