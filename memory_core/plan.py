"""A pass, planned on the host: which slot each class-token row reads, which head each output applies.

Per image, the rows are the adapters it asks for plus, in extension mode, their ancestors (an
extension's class token attends to theirs), in the set's order; every image gets R rows, and an
image needing fewer is padded with the null slot (memory_core/slots.py), whose rows compute finite
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

Either way each asked task's logits are one contiguous run of output rows (``TaskRows``), so the
output is cut per task with views, not copies.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .adapter_set import AdapterSet
from .errors import InputError
from .slots import NULL_SLOT, AdapterSlots, SlotPools, widths
from .staging import PinnedStaging


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


@dataclass(frozen=True)
class TaskRows:
    """Where one asked task's logits are among a pass's output rows."""

    name: str
    start: int
    stop: int
    classes: int  # C_k: the first C_k of the padded head's columns
    images: Tensor  # (stop - start,) long, on the host: the images these rows answer, ascending


@dataclass(frozen=True)
class PassPlan:
    shape: PlanShape
    batch: int  # images given (shape.images may pad them)
    host: Tensor  # int64 (sum of shape.lengths,): the packed plan, on the host
    tasks: tuple[TaskRows, ...]  # in the set's order
    pools: SlotPools  # the pools the slots are valid in, narrowed to (shape.memory, shape.classes)
    adapter_set: AdapterSet

    def tensors(self, device: torch.device, staging: PinnedStaging | None = None) -> PlanTensors:
        """The plan on ``device``: one copy of the packed buffer, through ``staging``'s pinned buffers
        on CUDA so that the host does not wait for it."""
        if device.type == "cuda" and staging is not None:
            buffer = staging.copy(self.host, torch.empty_like(self.host, device=device))
        else:
            buffer = self.host.to(device)
        return PlanTensors.unpack(buffer, self.shape)


Bucket = Callable[[int], int]


def plan_pass(
    adapter_set: AdapterSet,
    slots: AdapterSlots,
    tasks: Sequence[Collection[str]] | None,
    batch: int,
    *,
    images: Bucket | None = None,
    rows: Bucket | None = None,
    pad_outputs: bool = False,
) -> PassPlan | None:
    """Plan ``batch`` images through ``adapter_set``: ``tasks[b]`` names what image b asks for (None:
    every adapter, for every image). Returns None when no image asks for any adapter (the base alone).

    ``images``/``rows``: bucket functions rounding the batch and the rows per image (and the lineage
    width) up, to the shapes a captured graph exists for; None keeps them exact. ``pad_outputs``
    gives a routed plan B * R outputs, the most it can have, so that its shape is (B, R)'s alone.
    Writes a slot for every adapter the pass needs that has none yet. Unknown names raise
    ``UnknownAdapterError``.
    """
    asked = _asked(adapter_set, tasks, batch)
    if asked is None:
        return None
    adapters = adapter_set.adapters
    lineages: dict[int, list[int]] = {}  # every adapter needed: itself, then its ancestors
    for k in sorted({k for ks in asked for k in ks}):
        chain = [adapter_set.index(n) for n in adapter_set.lineage(adapters[k].name)]
        for i, j in enumerate(chain):
            lineages.setdefault(j, chain[i:])
    needed = [sorted({j for k in ks for j in lineages[k]}) for ks in asked]
    everything = sorted(lineages)
    slot_list, pools = slots.assign([tuple(adapters[j] for j in lineages[k]) for k in everything])
    slot_of = dict(zip(everything, slot_list, strict=True))
    B = images(batch) if images is not None else batch
    R = max(len(rows_b) for rows_b in needed)
    R = rows(R) if rows is not None else R
    A = max(len(chain) for chain in lineages.values())
    A = rows(A) if rows is not None and A > 1 else A
    # The pass reads the pools only as wide as its own adapters need: its operations, and so its
    # rounding, are the same whatever else is resident (docs/design.md §2.10).
    memory = max(sum(adapters[j].memory_keys.shape[2] for j in chain) for chain in lineages.values())
    classes = max(adapters[k].head_weight.shape[0] for ks in asked for k in ks)
    P, C = widths(memory, classes)
    layout = _Layout(adapter_set, lineages, slot_of, batch, B, R, A, P, C, pools.narrowed(P, C))
    if all(rows_b == needed[0] for rows_b in needed) and all(ks == asked[0] for ks in asked):
        return layout.shared(needed[0], asked[0])
    return layout.routed(needed, asked, pad_outputs)


def _asked(adapter_set: AdapterSet, tasks: Sequence[Collection[str]] | None, batch: int) -> list | None:
    """Per image, the set indices it asks for (sorted); None when nobody asks for anything."""
    if tasks is None:
        every = list(range(len(adapter_set)))
        return [every] * batch if every and batch else None
    if len(tasks) != batch:
        raise InputError(f"tasks: {len(tasks)} entries for {batch} images; give one collection per image")
    asked = []
    for names in tasks:
        if isinstance(names, str):
            raise InputError("tasks: give each image a collection of adapter names, not a string")
        asked.append(sorted({adapter_set.index(name) for name in names}))  # raises for an unknown name
    return asked if any(asked) else None


@dataclass(frozen=True)
class _Layout:
    """What both layouts need: the set, each needed adapter's lineage and slot, and the shape."""

    adapter_set: AdapterSet
    lineages: dict[int, list[int]]
    slot_of: dict[int, int]
    batch: int
    B: int
    R: int
    A: int
    P: int
    C: int
    pools: SlotPools

    def row_slots(self, rows: list[int]) -> list[int]:
        """One image's R row slots: its rows', then the null slot."""
        return [self.slot_of[k] for k in rows] + [NULL_SLOT] * (self.R - len(rows))

    def lineage_rows(self, rows: list[int]) -> list[int]:
        """One image's (R, A) lineage as row positions (itself first), -1 on padding; a padding row
        attends to itself alone. Empty in concatenation mode (A = 1)."""
        if self.A == 1:
            return []
        position = {k: i for i, k in enumerate(rows)}
        out = []
        for r in range(self.R):
            chain = [position[j] for j in self.lineages[rows[r]]] if r < len(rows) else [r]
            out += chain + [-1] * (self.A - len(chain))
        return out

    def task(self, k: int, start: int, stop: int, images: Tensor) -> TaskRows:
        adapter = self.adapter_set.adapters[k]
        return TaskRows(adapter.name, start, stop, adapter.head_weight.shape[0], images)

    def shared(self, rows: list[int], asked: list[int]) -> PassPlan:
        """Every image the same rows: outputs are (R, B), row r's B images from r * B."""
        shape = PlanShape(self.B, self.R, self.A, shared=True, outputs=0, memory=self.P, classes=self.C)
        every = torch.arange(self.batch)
        tasks = []
        for k in asked:
            start = rows.index(k) * self.B
            tasks.append(self.task(k, start, start + self.batch, every))
        host = torch.tensor(self.row_slots(rows) + self.lineage_rows(rows), dtype=torch.long)
        return PassPlan(shape, self.batch, host, tuple(tasks), self.pools, self.adapter_set)

    def routed(self, needed: list[list[int]], asked: list[list[int]], pad_outputs: bool) -> PassPlan:
        """Rows per image; outputs are the (image, asked task) pairs, by task then image."""
        padding = [[]] * (self.B - self.batch)  # images added by bucketing: null rows only
        row_slots = [s for rows in needed + padding for s in self.row_slots(rows)]
        lineage = [p for rows in needed + padding for p in self.lineage_rows(rows)]
        askers: dict[int, list[int]] = {}
        for b, ks in enumerate(asked):
            for k in ks:
                askers.setdefault(k, []).append(b)
        out_rows: list[int] = []
        out_slots: list[int] = []
        tasks = []
        for k in sorted(askers):  # the set's order
            start = len(out_rows)
            out_rows += [b * self.R + needed[b].index(k) for b in askers[k]]
            out_slots += [self.slot_of[k]] * len(askers[k])
            tasks.append(self.task(k, start, len(out_rows), torch.tensor(askers[k], dtype=torch.long)))
        N = self.B * self.R if pad_outputs else len(out_rows)
        out_rows += [0] * (N - len(out_rows))  # padding outputs: row 0's null head, never read
        out_slots += [NULL_SLOT] * (N - len(out_slots))
        shape = PlanShape(self.B, self.R, self.A, shared=False, outputs=N, memory=self.P, classes=self.C)
        host = torch.tensor(row_slots + lineage + out_rows + out_slots, dtype=torch.long)
        return PassPlan(shape, self.batch, host, tuple(tasks), self.pools, self.adapter_set)
