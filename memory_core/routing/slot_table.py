"""An adapter set's slot table: what a plan needs of each adapter, as numpy arrays, built once.

A pass is planned from the set's positions alone (memory_core/routing/plan.py): which slot each adapter
holds, how many classes its head has, how much memory its rows read (its own plus its ancestors')
and its lineage. Reading those from the prepared adapters per pass is a Python loop over images x
tasks; the table holds them as arrays, written when the set is installed (``LiveAdapters.install``)
or first run, never per pass, so a plan is a few vectorised numpy operations (vLLM keeps its LoRA
mapping the same way: host arrays, copied once per step).

A table is valid for its set's lifetime on one ``AdapterSlots``: the set holds its adapters, a slot is
freed only when its adapter is, and slots never move when the pools grow (memory_core/routing/slots.py).
An installed set has every adapter in a slot; a set run without being installed gets a slot for an
adapter the first time a plan needs it (``ensure``), so a pass over a few of its adapters writes those.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..sets.adapter_set import AdapterSet

if TYPE_CHECKING:
    from .slots import AdapterSlots


def table_of(adapter_set: AdapterSet, slots: AdapterSlots) -> SlotTable:
    """What a plan needs of each adapter of ``adapter_set`` on ``slots``, as arrays: built once and
    kept on the set (``LiveAdapters.install`` builds it for the server's sets), rebuilt only if asked
    for another engine's slots."""
    table = adapter_set._table
    if table is None or table.slots() is not slots:
        table = adapter_set._table = SlotTable.build(adapter_set, slots)
    return table


@dataclass(frozen=True, eq=False)
class SlotTable:
    """Per adapter of one set (by position): slot, classes, visible memory, lineage."""

    slot: np.ndarray  # (K,) int64: the adapter's slot in the engine's pools; -1 until it has one
    classes: np.ndarray  # (K,) int64: C_k
    memory: np.ndarray  # (K,) int64: memory entries its rows read (its own, then its ancestors')
    lineage: np.ndarray  # (K, A) int64 set positions, itself first, -1 padding; A = 1 without extensions
    every: np.ndarray = field(init=False)  # (K,) int64: 0..K-1, the all-tasks pass's tasks
    sizes: np.ndarray = field(init=False)  # (2, K) int64: memory, classes
    complete: bool = field(init=False)  # every adapter has its slot (an installed set's table)
    slots: weakref.ref = field(default=lambda: None, repr=False)  # the AdapterSlots it is valid on
    # The all-tasks plan's arrays per shape (memory_core/routing/plan.py): the same for every such pass.
    plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for array in (self.classes, self.memory, self.lineage):
            array.setflags(write=False)  # shared by every plan of the set
        every = np.arange(len(self.slot), dtype=np.int64)
        every.setflags(write=False)
        object.__setattr__(self, "every", every)
        sizes = np.stack([self.memory, self.classes])  # one take and one max per plan (rows: fast)
        sizes.setflags(write=False)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "complete", bool((self.slot >= 0).all()))

    def __len__(self) -> int:
        return len(self.slot)

    @property
    def depth(self) -> int:
        """A: the longest lineage (1 in concatenation mode)."""
        return self.lineage.shape[1]

    @classmethod
    def build(cls, adapter_set: AdapterSet, slots: AdapterSlots) -> SlotTable:
        """The table of ``adapter_set`` on ``slots``: the slots its adapters already hold (all of them
        once installed), -1 for the others. Linear in the set's size, once per set."""
        adapters = adapter_set.adapters
        K = len(adapters)
        if all(a.parent is None for a in adapters):  # concatenation mode: each row is itself alone
            lineage = np.arange(K, dtype=np.int64).reshape(K, 1)
            found = (slots.slot_of(a) for a in adapters)
            memory = np.fromiter((a.memory_keys.shape[2] for a in adapters), np.int64, K)
        else:
            chains = [
                [i] if a.parent is None else [adapter_set.index(n) for n in adapter_set.lineage(a.name)]
                for i, a in enumerate(adapters)
            ]
            found = (slots.slot_of(adapters[c[0]], tuple(adapters[j] for j in c[1:])) for c in chains)
            lineage = np.full((K, max(len(c) for c in chains)), -1, dtype=np.int64)
            for i, chain in enumerate(chains):
                lineage[i, : len(chain)] = chain
            memory = np.fromiter(
                (sum(adapters[j].memory_keys.shape[2] for j in c) for c in chains), np.int64, K
            )
        return cls(
            slot=np.fromiter((-1 if s is None else s for s in found), np.int64, K),
            classes=np.fromiter((a.head_weight.shape[0] for a in adapters), np.int64, K),
            memory=memory,
            lineage=lineage,
            slots=weakref.ref(slots),
        )

    def ensure(self, needed: np.ndarray, adapter_set: AdapterSet, slots: AdapterSlots) -> None:
        """Give each adapter at positions ``needed`` a slot if it has none (a set not installed)."""
        missing = needed[self.slot[needed] < 0]
        if missing.size == 0:
            return
        missing = np.unique(missing)
        adapters = adapter_set.adapters
        chains = [tuple(adapters[j] for j in self.lineage[i] if j >= 0) for i in missing.tolist()]
        assigned, _ = slots.assign(chains)
        self.slot[missing] = assigned
        object.__setattr__(self, "complete", bool((self.slot >= 0).all()))
