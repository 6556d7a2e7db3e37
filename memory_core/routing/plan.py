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
  per asked task and image, image by image (the batch's ``TaskIndex`` order: nothing to sort), each
  naming its class-token row and its slot.

The plan's index says where each task's answers lie (memory_core/output/index.py: ``OutputIndex``, a
run per task, when shared; ``PairIndex`` when routed): the output is cut when read, not per pass.

How a plan is computed from the set's slot table and the batch's tasks is routing/planner.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..output.index import OutputIndex, PairIndex
from ..sets.adapter_set import AdapterSet
from .slots import SlotPools
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
    index: OutputIndex | PairIndex  # where each asked task's answers are among the output rows
    pools: SlotPools  # the pools the slots are valid in, narrowed to (shape.memory, shape.classes)
    adapter_set: AdapterSet
    buffer: HostBuffer | None = None  # the host buffer ``host`` lives in, to send from
    # The set's kept all-tasks plan that ``host`` is (read-only, no buffer): a graph whose static plan
    # already holds it is not sent it again (memory_core/routing/graphs.py).
    kept: np.ndarray | None = None
    # ``kept`` as a tensor over the same memory, made once before the array was made read-only (torch
    # warns on a read-only array): what a CPU pass reads.
    kept_tensor: Tensor | None = None

    @cached_property
    def head_run(self) -> int | None:
        """The first slot when a shared plan's R rows read consecutive slots s, s+1, ..., s+R-1 (a
        set's all-tasks plan does until churn scatters its slots), else None: their heads are then
        one view of the pool, which a pass that is not captured reads in place instead of gathering
        them (routing/planned.py ``shared_heads``). Numpy over the packed plan, once per kept plan."""
        if not self.shape.shared or self.shape.rows == 0:
            return None
        slots = self.host[: self.shape.rows]
        first = int(slots[0])
        return first if np.array_equal(slots, np.arange(first, first + slots.size)) else None

    @cached_property
    def _kept_views(self) -> PlanTensors:
        """A kept plan's tensors on the host, unpacked once (every batch of its size reads the same
        read-only memory; a split per batch was a fifth of a small batch's forward on the host)."""
        assert self.kept_tensor is not None
        return PlanTensors.unpack(self.kept_tensor, self.shape)

    @property
    def generation(self) -> int:
        return self.pools.generation

    def tensors(self, device: torch.device, buffers: HostBuffers | None = None) -> PlanTensors:
        """The plan on ``device``: on the host, the packed array itself; on CUDA one non-blocking
        copy from a (pinned) host buffer."""
        if device.type == "cpu":
            if self.kept_tensor is not None:  # a kept plan: its views, made once
                return self._kept_views
            return PlanTensors.unpack(torch.from_numpy(self.host), self.shape)
        buffers = buffers if buffers is not None else HostBuffers()
        buffer = self.buffer
        if buffer is None:
            buffer = buffers.acquire(self.host.size)
            buffer.array[:] = self.host
        target = torch.empty(self.host.size, dtype=torch.long, device=device)
        return PlanTensors.unpack(buffers.send(buffer, target), self.shape)
