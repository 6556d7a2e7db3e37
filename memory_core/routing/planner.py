"""Planning a pass (``plan_pass``): a batch's tasks and the set's slot table -> a ``PassPlan``
(routing/plan.py says what a plan holds, and its two layouts).

The plan is numpy over the set's slot table (routing/slot_table.py) and the batch's ``TaskIndex``
(sets/task_index.py): a few vectorised operations (repeat, unique, searchsorted, fancy indexing), no
Python loop over images or tasks and no aten operation, written into a host buffer that one
non-blocking copy sends to the device (routing/staging.py). The all-tasks plan is the slot table
itself, kept per set and shape: O(1) per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from ..errors import InputError
from ..output.index import OutputIndex, PairIndex
from ..sets.adapter_set import AdapterSet
from ..sets.task_index import TaskIndex
from .plan import PassPlan, PlanShape
from .slot_table import table_of
from .slots import NULL_SLOT, AdapterSlots, widths
from .staging import HostBuffer, HostBuffers

Bucket = Callable[[int], int]
assert NULL_SLOT == 0  # one fill pads a routed plan: rows read the null slot, outputs row 0


def plan_pass(
    adapter_set: AdapterSet,
    slots: AdapterSlots,
    tasks: Sequence[Collection[str]] | TaskIndex | None,
    batch: int,
    *,
    images: Bucket | None = None,
    rows: Bucket | None = None,
    pad_outputs: bool = False,
    buffers: HostBuffers | None = None,
) -> PassPlan | None:
    """Plan ``batch`` images through ``adapter_set``: ``tasks`` says what each image asks for (a
    ``TaskIndex``, or per image a collection of names; None: every adapter, for every image).
    Returns None when no image asks for any adapter (the base alone).

    ``images``/``rows``: bucket functions rounding the batch and the rows per image (and the lineage
    width) up, to the shapes a captured graph exists for; None keeps them exact. ``pad_outputs``
    gives a routed plan B * R outputs, the most it can have, so that its shape is (B, R)'s alone.
    ``buffers``: where the packed plan is written (a host buffer to send from); None: a new array.
    The set's slot table is built on first use (writing any slot missing). Unknown names raise
    ``UnknownAdapterError``.
    """
    index = _task_index(adapter_set, tasks, batch)
    table = table_of(adapter_set, slots)
    if index is None:  # every adapter for every image: the plan kept for this batch and these pools
        if len(table) == 0 or batch == 0:
            return None
        key, pools = (batch, images, rows), slots.pools
        kept = table.plans.get(key)
        if kept is not None and kept[0] is pools:
            return kept[1]
        plan = _Planner(table, adapter_set, slots, batch, images, rows, buffers).shared(table.every, True)
        table.plans[key] = (pools, plan)  # the pools read before planning: still valid in them
        return plan
    if index.tasks.size == 0:
        return None
    planner = _Planner(table, adapter_set, slots, batch, images, rows, buffers)
    counts, asked = index.counts, index.tasks
    n = int(counts[0])
    # Shared when every image asks what image 0 does; most routed batches differ at image 1's first.
    maybe = n > 0 and asked.size == n * batch and (batch == 1 or asked[n] == asked[0])
    if maybe and (counts == n).all() and (asked.reshape(batch, n) == asked[:n]).all():
        return planner.shared(asked[:n], n == len(table))
    return planner.routed(index, pad_outputs)


def asks_nothing(tasks: Sequence[Collection[str]] | TaskIndex | None) -> bool:
    """Whether no image asks for an adapter (``plan_pass`` then returns None: the base pass alone),
    told without the set: O(1) for a TaskIndex, O(images) for names."""
    if tasks is None:
        return False
    if isinstance(tasks, TaskIndex):
        return tasks.tasks.size == 0
    return not any(len(t) for t in tasks)


def _task_index(
    adapter_set: AdapterSet, tasks: Sequence[Collection[str]] | TaskIndex | None, batch: int
) -> TaskIndex | None:
    if tasks is None:
        return None
    if isinstance(tasks, TaskIndex):
        if tasks.batch != batch:
            raise InputError(f"tasks: {tasks.batch} images indexed for a batch of {batch}")
        return tasks.remap(adapter_set)
    if len(tasks) != batch:
        raise InputError(f"tasks: {len(tasks)} entries for {batch} images; give one collection per image")
    return TaskIndex.from_names(adapter_set, tasks)


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    return np.cumsum(counts) - counts


class _Planner:
    """One plan's arrays, from the slot table: the shared layout or the routed one."""

    def __init__(self, table, adapter_set, slots, batch, images, rows, buffers) -> None:
        self.table, self.adapter_set, self.slots, self.batch = table, adapter_set, slots, batch
        self.B = images(batch) if images is not None else batch
        self.bucket = rows if rows is not None else (lambda n: n)
        self.buffers = buffers

    def _depth(self, needed: np.ndarray) -> int:
        """A: the longest lineage among the rows (1 in concatenation mode)."""
        if self.table.depth == 1:
            return 1
        return int((self.table.lineage[needed] >= 0).sum(axis=1).max())

    def _host(self, shape: PlanShape) -> tuple[np.ndarray, HostBuffer | None]:
        """Where the packed plan is written: a host buffer to send from, or a new array."""
        if self.buffers is None:
            return np.empty(shape.size, dtype=np.int64), None
        buffer = self.buffers.acquire(shape.size)
        return buffer.array, buffer

    def _plan(self, shape: PlanShape, host, buffer, index: OutputIndex | PairIndex) -> PassPlan:
        # The pass reads the pools only as wide as its own adapters need: its operations, and so its
        # rounding, are the same whatever else is resident (docs/design.md §2.10). Views made once.
        pools = self.slots.pools.narrowed(shape.memory, shape.classes)  # read after any slot written
        return PassPlan(shape, self.batch, host, index, pools, self.adapter_set, buffer)

    def shared(self, asked: np.ndarray, every: bool) -> PassPlan:
        """Every image asks for ``asked``: one (R,) row list, outputs (R, B), row r's images from r * B.
        The all-tasks plan (``every``) is kept by ``plan_pass`` per batch: not even copied."""
        batch = self.batch
        shape, packed, starts, classes = self._shared_arrays(asked)
        index = OutputIndex(asked, starts, np.full(asked.size, batch, dtype=np.int64), classes, None, batch)
        if every:  # kept (plan_pass): the array itself, sent only to a graph that does not hold it yet
            tensor = torch.from_numpy(packed)  # before the array is made read-only
            packed.setflags(write=False)
            pools = self.slots.pools.narrowed(shape.memory, shape.classes)
            return PassPlan(shape, batch, packed, index, pools, self.adapter_set, None, packed, tensor)
        host, buffer = self._host(shape)
        host[:] = packed
        return self._plan(shape, host, buffer, index)

    def _shared_arrays(self, asked: np.ndarray) -> tuple:
        table, B = self.table, self.B
        lineage = table.lineage
        needed = asked if table.depth == 1 else np.unique(lineage[asked][lineage[asked] >= 0])
        R, A = needed.size, self._depth(needed)
        Rb = self.bucket(R)
        Ab = self.bucket(A) if A > 1 else 1
        table.ensure(needed, self.adapter_set, self.slots)
        P, C = widths(int(table.memory[needed].max()), int(table.classes[asked].max()))
        shape = PlanShape(B, Rb, Ab, shared=True, outputs=0, memory=P, classes=C)
        packed = np.empty(shape.size, dtype=np.int64)
        packed[:Rb] = NULL_SLOT
        packed[:R] = table.slot[needed]
        if Ab > 1:  # each row's lineage as row positions, itself first; padding rows see themselves
            chain = lineage[needed, :A]
            lin = packed[Rb:].reshape(Rb, Ab)
            lin[:] = -1
            lin[:, 0] = np.arange(Rb)
            lin[:R, :A] = np.where(chain >= 0, np.searchsorted(needed, chain), -1)
        starts = np.searchsorted(needed, asked) * B
        return shape, packed, starts, table.classes[asked]

    def routed(self, index: TaskIndex, pad_outputs: bool) -> PassPlan:
        """Rows per image; outputs are the (image, asked task) pairs in the index's own order, image by
        image (``PairIndex``): nothing is sorted before the launch, and where each task's answers lie
        is found when they are read, while the device runs."""
        table, batch, B = self.table, self.batch, self.B
        if table.depth == 1:
            return self._routed_alone(index, pad_outputs)
        K = len(table)
        counts, asked, offsets = index.counts, index.tasks, index.offsets
        image = np.repeat(np.arange(batch, dtype=np.int64), counts)  # (M,) per asked pair
        if table.depth == 1:  # the rows are the tasks asked (unique and ascending per image)
            keys, row_image, needed = None, image, asked
            position = np.arange(asked.size) - offsets[image]  # each row's place among its image's
            R, A = int(counts.max()), 1
        else:  # and their ancestors, image-major, in set order within an image
            chain = table.lineage[asked]
            keys = np.unique((image[:, None] * K + chain)[chain >= 0])
            row_image, needed = np.divmod(keys, K)
            first = _exclusive_cumsum(np.bincount(row_image, minlength=batch))
            position = np.arange(needed.size) - first[row_image]
            R, A = int(position.max()) + 1, self._depth(needed)
        Rb = self.bucket(R)
        Ab = self.bucket(A) if A > 1 else 1
        slots = table.slot[needed]
        if slots.min() < 0:  # a set not installed: give them slots first
            table.ensure(needed, self.adapter_set, self.slots)
            slots = table.slot[needed]
        P, C = widths(int(table.memory[needed].max()), int(table.classes[asked].max()))
        n = asked.size
        N = B * Rb if pad_outputs else n
        shape = PlanShape(B, Rb, Ab, shared=False, outputs=N, memory=P, classes=C)
        # Written straight into the host buffer, in ``PlanShape.lengths`` order.
        host, buffer = self._host(shape)
        at = B * Rb
        host[:at] = NULL_SLOT  # row slots (B, Rb), flat: row r of image b is b * Rb + r
        flat_rows = row_image * Rb + position
        host[flat_rows] = slots
        if Ab > 1:
            chain = table.lineage[needed, :A]
            found = np.searchsorted(keys, row_image[:, None] * K + chain) - first[row_image][:, None]
            lin = host[at : at + B * Rb * Ab].reshape(B, Rb, Ab)
            lin[:] = -1
            lin[:, :, 0] = np.arange(Rb)
            lin[row_image, position, :A] = np.where(chain >= 0, found, -1)
            at += lin.size
            out_rows = image * Rb + np.searchsorted(keys, image * K + asked) - first[image]
            out_slots = table.slot[asked]
        else:
            out_rows, out_slots = flat_rows, slots
        host[at : at + n] = out_rows  # each output's class-token row
        host[at + n : at + N] = 0  # padding outputs: row 0's null head, never read
        host[at + N : at + N + n] = out_slots
        host[at + N + n : at + 2 * N] = NULL_SLOT
        return self._plan(shape, host, buffer, PairIndex(offsets, asked, table.classes, batch))

    def _routed_alone(self, index: TaskIndex, pad_outputs: bool) -> PassPlan:
        """``routed`` in concatenation mode (each row its own task alone) in as few numpy calls as it
        takes: the plan runs before the launch, and on a GPU's host each call is time the GPU idles."""
        table, batch, B = self.table, self.batch, self.B
        counts, asked, offsets = index.counts, index.tasks, index.offsets
        n = asked.size
        Rb = self.bucket(int(counts.max()))
        slots = table.slot[asked]
        if not table.complete and slots.min() < 0:  # a set not installed: give them slots first
            table.ensure(asked, self.adapter_set, self.slots)
            slots = table.slot[asked]
        P, C = widths(*table.sizes.take(asked, axis=1).max(axis=1).tolist())
        N = B * Rb if pad_outputs else n
        shape = PlanShape(B, Rb, 1, shared=False, outputs=N, memory=P, classes=C)
        host, buffer = self._host(shape)
        host[:] = NULL_SLOT  # padding: rows read the null slot, outputs row 0 (both 0)
        # Pair j of image b is its row j - offsets[b], flat row b * Rb + j - offsets[b].
        rows = np.repeat(np.arange(batch, dtype=np.int64) * Rb - offsets[:-1], counts) + np.arange(n)
        host[rows] = slots  # the row slots (B, Rb)
        at = B * Rb
        host[at : at + n] = rows  # each output's class-token row
        host[at + N : at + N + n] = slots  # and its head
        return self._plan(shape, host, buffer, PairIndex(offsets, asked, table.classes, batch))
