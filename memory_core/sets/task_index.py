"""What each image of a batch asks for, as positions in one adapter-set snapshot: the plan's input.

A request names tasks; the process that runs the pass turns the names into positions in the snapshot
the batch runs on, once per request (``uniform``: O(tasks asked), whatever the set holds), and a batch
joins its requests' indices (``join``). The plan then reads positions only (memory_core/routing/plan.py).
Positions are only meaningful in their snapshot: a batch that runs on a newer one ``remap``s them,
which refuses, naming them, the adapters gone since, and never reuses a stale position.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import InputError, UnknownAdapterError
from .adapter_set import AdapterSet


@dataclass(frozen=True, eq=False)
class TaskIndex:
    """Per image, the set positions it asks for (ascending, unique): a CSR over the batch."""

    offsets: np.ndarray  # (B+1,) int64: image b asks for tasks[offsets[b]:offsets[b+1]]
    tasks: np.ndarray  # (M,) int64 positions in ``adapter_set``
    adapter_set: AdapterSet

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or self.offsets.size < 1 or self.offsets[0] != 0:
            raise ValueError("offsets must be (B+1,) starting at 0")
        if self.offsets[-1] != self.tasks.size:
            raise ValueError(f"offsets end at {self.offsets[-1]}, tasks hold {self.tasks.size}")

    @property
    def batch(self) -> int:
        return self.offsets.size - 1

    @cached_property
    def counts(self) -> np.ndarray:
        """(B,) tasks asked per image (worked out once: a plan reads it twice)."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.batch

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def positions(cls, adapter_set: AdapterSet, names: Collection[str]) -> np.ndarray:
        """``names`` as ascending unique positions in ``adapter_set`` (UnknownAdapterError names the
        first it lacks). O(len(names))."""
        if isinstance(names, str):
            raise InputError("tasks: give each image a collection of adapter names, not a string")
        found = np.fromiter((adapter_set.index(n) for n in names), np.int64, len(names))
        return np.unique(found)

    @classmethod
    def uniform(cls, adapter_set: AdapterSet, names: Collection[str], batch: int) -> TaskIndex:
        """``batch`` images all asking for ``names`` (one request's images)."""
        row = cls.positions(adapter_set, names)
        return cls(np.arange(batch + 1, dtype=np.int64) * row.size, np.tile(row, batch), adapter_set)

    @classmethod
    def every(cls, adapter_set: AdapterSet, batch: int) -> TaskIndex:
        """``batch`` images asking for every adapter of the set."""
        K = len(adapter_set)
        return cls(np.arange(batch + 1, dtype=np.int64) * K, np.tile(np.arange(K), batch), adapter_set)

    @classmethod
    def from_names(cls, adapter_set: AdapterSet, tasks: Sequence[Collection[str]]) -> TaskIndex:
        """Per image, a collection of adapter names (an image may ask for none). One lookup per name,
        then numpy: ascending, duplicates dropped, per image."""
        index, flat, sizes = adapter_set.index, [], []
        for names in tasks:  # one pass in Python: what the names are, nothing else
            if isinstance(names, str):
                raise InputError("tasks: give each image a collection of adapter names, not a string")
            flat.extend(map(index, names))
            sizes.append(len(names))
        counts, found = np.array(sizes, dtype=np.int64), np.array(flat, dtype=np.int64)
        K = max(len(adapter_set), 1)
        keys = np.unique(np.repeat(np.arange(len(tasks), dtype=np.int64), counts) * K + found)
        image, positions = np.divmod(keys, K)
        offsets = np.zeros(len(tasks) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(np.bincount(image, minlength=len(tasks)))
        return cls(offsets, positions, adapter_set)

    @classmethod
    def empty(cls, adapter_set: AdapterSet) -> TaskIndex:
        return cls(np.zeros(1, np.int64), np.zeros(0, np.int64), adapter_set)

    @classmethod
    def join(cls, parts: Sequence[TaskIndex]) -> TaskIndex:
        """Consecutive runs of images (a batch's requests) as one index; one snapshot for all."""
        adapter_set = parts[0].adapter_set
        if any(p.adapter_set is not adapter_set for p in parts):
            raise ValueError("the parts of one batch must index the same adapter set (remap them first)")
        if len(parts) == 1:
            return parts[0]
        ends = np.cumsum([p.tasks.size for p in parts[:-1]], dtype=np.int64)
        shifted = [parts[0].offsets] + [p.offsets[1:] + at for p, at in zip(parts[1:], ends, strict=True)]
        return cls(np.concatenate(shifted), np.concatenate([p.tasks for p in parts]), adapter_set)

    # -- another snapshot ----------------------------------------------------------------------
    def remap(self, adapter_set: AdapterSet) -> TaskIndex:
        """The same asks as positions in ``adapter_set`` (a newer snapshot). Raises
        ``UnknownAdapterError`` naming the asked adapters it no longer holds."""
        if adapter_set is self.adapter_set:
            return self
        if self.tasks.size == 0:
            return TaskIndex(self.offsets, self.tasks, adapter_set)
        asked = np.unique(self.tasks)  # O(tasks asked), whatever either set holds
        old = self.adapter_set.names
        names = [old[i] for i in asked.tolist()]
        if gone := [n for n in names if n not in adapter_set]:
            raise UnknownAdapterError(
                f"no adapter named {', '.join(map(repr, gone))} is loaded any more", field="name"
            )
        moved = np.fromiter((adapter_set.index(n) for n in names), np.int64, len(names))
        tasks = moved[np.searchsorted(asked, self.tasks)]
        # Positions may reorder in the new set: keep each image's run ascending.
        image = np.repeat(np.arange(self.batch), self.counts)
        order = np.lexsort((tasks, image))
        return TaskIndex(self.offsets, tasks[order], adapter_set)

    def names(self, b: int) -> list[str]:
        """Image ``b``'s task names (tests and messages)."""
        names = self.adapter_set.names
        return [names[i] for i in self.tasks[self.offsets[b] : self.offsets[b + 1]].tolist()]
