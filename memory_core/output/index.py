"""Where each asked (image, task) answer lies among a pass's adapter output rows: numpy, on the host.

A planned pass returns its adapter logits as one flat (N, C) tensor (memory_core/routing/plan.py).
Two layouts, one interface:

- ``OutputIndex`` (a shared plan, or outputs built per task): each task's answers are one contiguous
  run of rows, ordered by image; the index says where the runs are.
- ``PairIndex`` (a routed plan): one row per asked (image, task) pair, image by image, each image's
  tasks ascending: the batch's ``TaskIndex`` order itself, so the plan sorts nothing before the
  launch. A request's share is one contiguous range of rows; where one task's rows lie is found
  when that task is read, on the host, while the device runs.

Either way nothing is cut per task when the pass returns: a task's logits are cut when someone reads
them (``FusedOutput.adapters[name]``), and a request's share of a batch is one fancy index
(``answers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Answers:
    """A run of images' answers, ordered by image, then by task in the set's order."""

    image: np.ndarray  # (n,) int64, relative to the first image asked about
    task: np.ndarray  # (n,) int64 set positions
    row: np.ndarray  # (n,) int64 rows of the pass's flat logits
    classes: np.ndarray  # (n,) int64: the row's real columns (the rest are padding)

    def __len__(self) -> int:
        return self.row.size


@dataclass(frozen=True, eq=False)
class OutputIndex:
    """Task t (``tasks[t]``, a set position) answers ``counts[t]`` images in rows ``starts[t]`` on."""

    tasks: np.ndarray  # (T,) int64 set positions, ascending
    starts: np.ndarray  # (T,) int64 first row of each task's run
    counts: np.ndarray  # (T,) int64 images each task answers
    classes: np.ndarray  # (T,) int64 C_k
    # (sum(counts),) int64: the image of each answer, task after task, ascending within a task; None
    # when every task answers every image 0..batch-1 (a shared plan)
    images: np.ndarray | None
    batch: int
    _by_image: list = field(default_factory=list, repr=False)  # cache of ``_image_order``

    def __len__(self) -> int:
        return self.tasks.size

    def find(self, position: int) -> int | None:
        """The run of set position ``position``, or None if the pass did not answer it."""
        t = int(np.searchsorted(self.tasks, position))
        return t if t < self.tasks.size and self.tasks[t] == position else None

    def cut(self, flat: Tensor, t: int) -> Tensor:
        """Task ``t``'s logits (n_t, C_t) of the flat (N, C) logits: a view."""
        start, count = int(self.starts[t]), int(self.counts[t])
        return flat[start : start + count, : int(self.classes[t])]

    def image_run(self, t: int) -> np.ndarray:
        """The images task ``t`` answers, ascending."""
        if self.images is None:
            return np.arange(self.counts[t], dtype=np.int64)
        first = int(self.counts[:t].sum())
        return self.images[first : first + int(self.counts[t])]

    def window(self, lo: int, hi: int) -> OutputIndex:
        """The answers of images [lo, hi), renumbered from ``lo``."""
        if self.images is None:
            n = hi - lo
            keep = slice(None) if n > 0 else slice(0, 0)
            counts = np.full(self.tasks[keep].size, n, dtype=np.int64)
            return OutputIndex(self.tasks[keep], self.starts[keep] + lo, counts, self.classes[keep], None, n)
        task = np.repeat(np.arange(self.tasks.size), self.counts)
        inside = (self.images >= lo) & (self.images < hi)
        before = np.bincount(task[self.images < lo], minlength=self.tasks.size)  # answers left out
        counts = np.bincount(task[inside], minlength=self.tasks.size)
        keep = counts > 0
        starts = self.starts + before
        images = self.images[inside] - lo
        return OutputIndex(self.tasks[keep], starts[keep], counts[keep], self.classes[keep], images, hi - lo)

    def answers(self, lo: int = 0, hi: int | None = None) -> Answers:
        """Every answer for images [lo, hi), by image then task: what a request's response reads."""
        hi = self.batch if hi is None else hi
        if self.images is None:
            n, T = hi - lo, self.tasks.size
            image = np.repeat(np.arange(n, dtype=np.int64), T)
            return Answers(
                image, np.tile(self.tasks, n), np.tile(self.starts, n) + lo + image, np.tile(self.classes, n)
            )
        order, image, bounds = self._image_order()
        picked = order[bounds[lo] : bounds[hi]]
        task = self._task_of(picked)
        return Answers(image[picked] - lo, self.tasks[task], self._row_of(picked, task), self.classes[task])

    # -- the per-image order, built on first use (the plan never pays for it) ----------------------
    def _image_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._by_image:
            image = self.images
            order = np.argsort(image, kind="stable")  # by image; tasks stay in set order within one
            bounds = np.searchsorted(image[order], np.arange(self.batch + 1))
            self._by_image.append((order, image, bounds))
        return self._by_image[0]

    def _task_of(self, answer: np.ndarray) -> np.ndarray:
        ends = np.cumsum(self.counts)
        return np.searchsorted(ends, answer, side="right")

    def _row_of(self, answer: np.ndarray, task: np.ndarray) -> np.ndarray:
        firsts = np.cumsum(self.counts) - self.counts
        return self.starts[task] + (answer - firsts[task])


@dataclass(frozen=True, eq=False)
class PairIndex:
    """A routed pass's answers: rows ``first + offsets[b]`` to ``first + offsets[b+1]`` answer image b,
    one per task it asked, ascending (``pairs``: each answer's set position)."""

    offsets: np.ndarray  # (B+1,) int64, from 0
    pairs: np.ndarray  # (M,) int64 set positions, ascending within each image
    set_classes: np.ndarray  # (K,) int64 C_k by set position (the set's slot table, read-only)
    batch: int
    first: int = 0  # the flat row of answer 0 (a window's first answer)
    _cache: dict = field(default_factory=dict, repr=False)  # tasks, each answer's image, by task

    @property
    def tasks(self) -> np.ndarray:
        """(T,) the set positions answered, ascending."""
        tasks = self._cache.get("tasks")
        if tasks is None:
            tasks = self._cache["tasks"] = np.unique(self.pairs)
        return tasks

    @property
    def classes(self) -> np.ndarray:
        """(T,) C_k of each task answered."""
        return self.set_classes[self.tasks]

    def __len__(self) -> int:
        return self.tasks.size

    def find(self, position: int) -> int | None:
        """The index in ``tasks`` of set position ``position``, or None if the pass did not answer it."""
        tasks = self.tasks
        t = int(np.searchsorted(tasks, position))
        return t if t < tasks.size and tasks[t] == position else None

    def _images(self) -> np.ndarray:
        image = self._cache.get("images")
        if image is None:
            counts = self.offsets[1:] - self.offsets[:-1]
            image = self._cache["images"] = np.repeat(np.arange(self.batch, dtype=np.int64), counts)
        return image

    def answers_of(self, t: int) -> np.ndarray:
        """Task ``t``'s answers (positions among ``pairs``), by image."""
        by_task = self._cache.get("by task")
        if by_task is None:  # once, on the first task read: every task's answers, task after task
            order = np.argsort(self.pairs, kind="stable")  # stable: by image within a task
            bounds = np.searchsorted(self.pairs[order], np.append(self.tasks, np.iinfo(np.int64).max))
            by_task = self._cache["by task"] = (order, bounds)
        order, bounds = by_task
        return order[bounds[t] : bounds[t + 1]]

    def image_run(self, t: int) -> np.ndarray:
        """The images task ``t`` answers, ascending."""
        return self._images()[self.answers_of(t)]

    def cut(self, flat: Tensor, t: int) -> Tensor:
        """Task ``t``'s logits (n_t, C_t) of the flat (N, C) logits: a view when its rows are one run
        (one image, or a task every image in between asked), else gathered."""
        rows = self.answers_of(t) + self.first
        classes = int(self.set_classes[self.tasks[t]])
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if hi - lo == rows.size:
            return flat[lo:hi, :classes]
        return flat.index_select(0, torch.from_numpy(rows).to(flat.device))[:, :classes]

    def window(self, lo: int, hi: int) -> PairIndex:
        """The answers of images [lo, hi), renumbered from ``lo``: rows of the same flat logits."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        offsets = self.offsets[lo : hi + 1] - a
        return PairIndex(offsets, self.pairs[a:b], self.set_classes, hi - lo, self.first + a)

    def answers(self, lo: int = 0, hi: int | None = None) -> Answers:
        """Every answer for images [lo, hi), by image then task: one range of rows."""
        hi = self.batch if hi is None else hi
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        counts = self.offsets[lo + 1 : hi + 1] - self.offsets[lo:hi]
        image = np.repeat(np.arange(hi - lo, dtype=np.int64), counts)
        task = self.pairs[a:b]
        rows = np.arange(a + self.first, b + self.first, dtype=np.int64)
        return Answers(image, task, rows, self.set_classes[task])
