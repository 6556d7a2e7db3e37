"""A pass, planned on the host: which slot each class-token row reads, which head each output applies.

Per image, the rows are the adapters it asks for plus, in extension mode, their ancestors (an
extension's class token attends to theirs), in the set's order; every image gets R rows, and an
image needing fewer is padded with the null slot (memory_core/routing/slots.py), whose rows compute finite
numbers nobody reads. The plan is a few small integer tensors, packed into one host buffer and
copied to the device once per batch (``PassPlan.tensors``); every gather of the pass happens on the
device from them, so the pass makes no host round trip and its operations do not depend on which
adapters, or how many, are resident or asked (docs/design.md §2.10).

Two layouts:
- *shared*: every image asks for the same adapters (the all-tasks pass, or a batch asking for one
  task). Then the rows are one (R,) slot list for all images, and each row's head runs as one
  batched product over the images: the outputs are (R, B) rows, task-major.
- *routed*: rows differ per image, (B, R) slots. The outputs are the (image, asked task) pairs, one
  per asked task and image, ordered by task then image, each naming its class-token row and its slot.

Either way each asked task's logits are one contiguous run of output rows, which the plan's
``OutputIndex`` locates (memory_core/output/index.py): the output is cut when read, not per pass.

The plan is numpy over the set's slot table (memory_core/routing/slot_table.py) and the batch's ``TaskIndex``
(memory_core/sets/task_index.py): a few vectorised operations (repeat, unique, searchsorted, fancy
indexing), no Python loop over images or tasks and no aten operation, written into a host buffer
that one non-blocking copy sends to the device (memory_core/routing/staging.py). The all-tasks plan is the
slot table itself, kept per set and shape: O(1) per pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from ..output.index import OutputIndex
from ..sets.adapter_set import AdapterSet
from ..sets.task_index import TaskIndex
from .slot_table import table_of
from .slots import NULL_SLOT, AdapterSlots, SlotPools, widths
from .staging import HostBuffer, HostBuffers


@dataclass(frozen=True)
class PlanShape:
    """What a pass's device work depends on, besides the slot pools: the key of a captured graph."""

    images: int  # B, the batch (padded when bucketed)
    rows: int  # R, class-token rows per image
    lineage: int  # A, class tokens each row attends to (itself first); 1 in concatenation mode
    shared: bool  # one row list for every image
    outputs: int  # N, output rows of a routed plan (0 when shared: the outputs are (R, B))
    memory: int  # P, memory entries each row reads (a power of two: slots.widths)
    classes: int  # C, head columns computed (a power of two)

    @property
    def size(self) -> int:
        """Entries of the packed plan."""
        return sum(self.lengths)

    @property
    def lengths(self) -> tuple[int, int, int, int]:
        """Entries of each packed tensor: row slots, lineage, output rows, output slots."""
        rows = self.rows if self.shared else self.images * self.rows
        lineage = rows * self.lineage if self.lineage > 1 else 0
        return rows, lineage, self.outputs, self.outputs


class PlanTensors(NamedTuple):
    """A plan on the device: views of one int64 buffer."""

    row_slots: Tensor  # (B, R) long, or (R,) when shared
    lineage: Tensor | None  # (B, R, A) / (R, A) long row positions, -1 on padding; None when A == 1
    out_rows: Tensor | None  # (N,) long: flat index b * R + r of each output's class-token row
    out_slots: Tensor | None  # (N,) long: the slot whose head it applies

    @classmethod
    def unpack(cls, buffer: Tensor, shape: PlanShape) -> PlanTensors:
        """Views of ``buffer`` (as ``PassPlan.host`` packs it) in the shapes ``shape`` says."""
        parts = buffer.split(list(shape.lengths))
        B, R, A = shape.images, shape.rows, shape.lineage
        rows = parts[0] if shape.shared else parts[0].view(B, R)
        lineage = None
        if A > 1:
            lineage = parts[1].view(R, A) if shape.shared else parts[1].view(B, R, A)
        if shape.shared:
            return cls(rows, lineage, None, None)
        return cls(rows, lineage, parts[2], parts[3])


@dataclass(frozen=True, eq=False)
class PassPlan:
    shape: PlanShape
    batch: int  # images given (shape.images may pad them)
    host: np.ndarray  # int64 (shape.size,): the packed plan, on the host (``buffer``'s memory if any)
    index: OutputIndex  # where each asked task's answers are among the output rows
    pools: SlotPools  # the pools the slots are valid in, narrowed to (shape.memory, shape.classes)
    adapter_set: AdapterSet
    buffer: HostBuffer | None = None  # the host buffer ``host`` lives in, to send from
    # The set's kept all-tasks plan that ``host`` is (read-only, no buffer): a graph whose static plan
    # already holds it is not sent it again (memory_core/routing/graphs.py).
    kept: np.ndarray | None = None

    @property
    def generation(self) -> int:
        return self.pools.generation

    def tensors(self, device: torch.device, buffers: HostBuffers | None = None) -> PlanTensors:
        """The plan on ``device``: on the host, the packed array itself; on CUDA one non-blocking
        copy from a (pinned) host buffer."""
        if device.type == "cpu":
            if self.host.flags.writeable:
                return PlanTensors.unpack(torch.from_numpy(self.host), self.shape)
            with warnings.catch_warnings():  # the kept plan is read-only on purpose; the pass only reads it
                warnings.simplefilter("ignore", UserWarning)
                return PlanTensors.unpack(torch.from_numpy(self.host), self.shape)
        buffers = buffers if buffers is not None else HostBuffers()
        buffer = self.buffer
        if buffer is None:
            buffer = buffers.acquire(self.host.size)
            buffer.array[:] = self.host
        target = torch.empty(self.host.size, dtype=torch.long, device=device)
        return PlanTensors.unpack(buffers.send(buffer, target), self.shape)


Bucket = Callable[[int], int]


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
    if (counts == n).all() and (asked.reshape(batch, n) == asked[:n]).all():
        return planner.shared(asked[:n], n == len(table))
    return planner.routed(index, pad_outputs)


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

    def _plan(self, shape: PlanShape, host, buffer, index: OutputIndex) -> PassPlan:
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
            packed.setflags(write=False)
            pools = self.slots.pools.narrowed(shape.memory, shape.classes)
            return PassPlan(shape, batch, packed, index, pools, self.adapter_set, None, packed)
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
        """Rows per image; outputs are the (image, asked task) pairs, by task then image."""
        table, batch, B = self.table, self.batch, self.B
        K = len(table)
        image = np.repeat(np.arange(batch, dtype=np.int64), index.counts)  # (M,) per asked pair
        asked = index.tasks
        if table.depth == 1:  # the rows are the tasks asked (unique and ascending per image)
            keys, row_image, needed, first = None, image, asked, index.offsets[:-1]
        else:  # and their ancestors, image-major, in set order within an image
            chain = table.lineage[asked]
            keys = np.unique((image[:, None] * K + chain)[chain >= 0])
            row_image, needed = np.divmod(keys, K)
            first = _exclusive_cumsum(np.bincount(row_image, minlength=batch))
        position = np.arange(needed.size) - first[row_image]  # each row's place among its image's
        R, A = int(position.max()) + 1, self._depth(needed)
        Rb = self.bucket(R)
        Ab = self.bucket(A) if A > 1 else 1
        table.ensure(needed, self.adapter_set, self.slots)
        # Outputs, task-major: one run per task, its images ascending.
        order = np.argsort(asked * batch + image, kind="stable")
        task, who = asked[order], image[order]
        row = position[order] if keys is None else np.searchsorted(keys, who * K + task) - first[who]
        runs = np.flatnonzero(np.concatenate(([True], task[1:] != task[:-1])))  # each task's run
        counts = np.concatenate((runs[1:], [task.size])) - runs
        tasks = task[runs]
        P, C = widths(int(table.memory[needed].max()), int(table.classes[tasks].max()))
        N = B * Rb if pad_outputs else task.size
        shape = PlanShape(B, Rb, Ab, shared=False, outputs=N, memory=P, classes=C)
        # Written straight into the host buffer, in ``PlanShape.lengths`` order.
        host, buffer = self._host(shape)
        n, at = task.size, B * Rb
        row_slots = host[:at].reshape(B, Rb)
        row_slots[:] = NULL_SLOT
        row_slots[row_image, position] = table.slot[needed]
        if Ab > 1:
            chain = table.lineage[needed, :A]
            found = np.searchsorted(keys, row_image[:, None] * K + chain) - first[row_image][:, None]
            lin = host[at : at + B * Rb * Ab].reshape(B, Rb, Ab)
            lin[:] = -1
            lin[:, :, 0] = np.arange(Rb)
            lin[row_image, position, :A] = np.where(chain >= 0, found, -1)
            at += lin.size
        host[at : at + n] = who * Rb + row  # the output's class-token row
        host[at + n : at + N] = 0  # padding outputs: row 0's null head, never read
        host[at + N : at + N + n] = table.slot[task]
        host[at + N + n : at + 2 * N] = NULL_SLOT
        return self._plan(
            shape, host, buffer, OutputIndex(tasks, runs, counts, table.classes[tasks], who, batch)
        )
