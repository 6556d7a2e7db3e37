"""Adapter slots: every adapter an engine serves, in a few preallocated tensors on its device.

vLLM serves LoRA adapters from a fixed number of GPU slots (``max_loras``) and each pass only names
slots; S-LoRA keeps every resident adapter in one pool. memvit does the same for memory adapters.
``AdapterSlots`` holds, for S slots (docs/design.md §2.10):

    keys, values   (L, S, H, P, d)  each slot's visible memory per layer (its own, then its
                                    ancestors' in extension mode), zero-padded to the longest, P
    memory_bias    (S, P)           0 on a slot's memory, -inf on its padding
    memory_length  (S,)             how many of the P entries are real (kernels skip the rest)
    cls            (S, D)           class token plus the base class token's position embedding
    head_weight    (S, C, D)        heads, zero-padded to the most classes, C
    head_bias      (S, C)

Slot 0 is the null slot: no memory, a zero class token, a zero head. Padding rows of a pass point at
it, so they compute finite numbers that nobody reads.

A slot is written in place when an adapter first needs one (``assign``: ``LiveAdapters.install``
for the server's resident set, or the first pass that uses it) and freed when the adapter itself is
freed: a ``weakref.finalize`` hands the slot back once no adapter set, and so no pass, can still
name it. A pass therefore never stacks adapters; it reads the pools through the slot numbers its
plan carries (memory_core/routing/plan.py). Slots never move: when the pools must grow (more slots, longer
memory, more classes) they are copied into larger tensors, ``generation`` counts up, and whatever
was captured against the old tensors (CUDA graphs, memory_core/routing/graphs.py) is captured again.

Writes run on the caller's thread and, on CUDA, on the device's current stream, which is the stream
passes run on: a slot freed after a pass was launched is rewritten only after that pass's kernels.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sets.stack import PreparedAdapter, check_prepared_for
from ..weights.spec import ViTSpec

NULL_SLOT = 0
_WHOLE = object()  # SlotPools.narrowed's mark for the pools' own width
WRITE_CHUNK = 4096  # slots written per stacked copy (100,000 heads of ViT-B would stack 15 GB at once)


@dataclass(frozen=True)
class SlotPools:
    """The pool tensors at one generation. A pass reads one ``SlotPools`` throughout."""

    keys: Tensor  # (L, S, H, P, d)
    values: Tensor  # (L, S, H, P, d)
    memory_bias: Tensor  # (S, P) 0 / -inf
    memory_length: Tensor  # (S,) int32
    cls: Tensor  # (S, D)
    head_weight: Tensor  # (S, C, D)
    head_bias: Tensor  # (S, C)
    generation: int
    _narrowed: dict = field(default_factory=dict, compare=False, repr=False)  # (P, C) -> views

    @property
    def capacity(self) -> int:
        return self.cls.shape[0]

    @property
    def memory(self) -> int:
        return self.keys.shape[3]

    @property
    def classes(self) -> int:
        return self.head_weight.shape[1]

    def narrowed(self, memory: int, classes: int) -> SlotPools:
        """Views of the pools with P = ``memory`` and C = ``classes``: what one pass reads.

        A pass is as wide as its own adapters need, not as wide as the widest resident one, so
        that its operations, and so its float rounding, do not depend on what else is loaded."""
        narrowed = self._narrowed.get((memory, classes))  # made once per width
        if narrowed is not None:
            return self if narrowed is _WHOLE else narrowed  # not self kept in self: no cycle to collect
        if memory > self.memory or classes > self.classes:
            raise ValueError(f"P={memory}, C={classes} exceed the pools' P={self.memory}, C={self.classes}")
        if memory == self.memory and classes == self.classes:
            self._narrowed[memory, classes] = _WHOLE
            return self
        return self._narrowed.setdefault((memory, classes), self._views(memory, classes))

    def _views(self, memory: int, classes: int) -> SlotPools:
        return SlotPools(
            keys=self.keys[..., :memory, :],
            values=self.values[..., :memory, :],
            memory_bias=self.memory_bias[:, :memory],
            memory_length=self.memory_length,
            cls=self.cls,
            head_weight=self.head_weight[:, :classes],
            head_bias=self.head_bias[:, :classes],
            generation=self.generation,
        )

    @property
    def nbytes(self) -> int:
        tensors = (self.keys, self.values, self.memory_bias, self.memory_length, self.cls)
        return sum(t.nbytes for t in (*tensors, self.head_weight, self.head_bias))


@dataclass(frozen=True, eq=False)
class _Slot:
    adapter: weakref.ref  # the adapter the slot holds
    ancestors: tuple[PreparedAdapter, ...]  # kept alive while the slot is: their memory is in it
    classes: int
    memory: int  # visible memory: its own plus its ancestors'


class AdapterSlots:
    """The slot pools of one engine (device and dtype fixed), and which adapter holds which slot."""

    def __init__(
        self, spec: ViTSpec, device: torch.device, dtype: torch.dtype, *, capacity: int = 16
    ) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2 (the null slot and one adapter), got {capacity}")
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self._lock = threading.Lock()
        self._slot_of: dict[tuple[int, ...], int] = {}  # ids of (adapter, *ancestors) -> slot
        self._records: dict[int, _Slot] = {}
        self._free: list[int] = []
        # Filled by finalizers, which may run in any thread at any moment (garbage collection):
        # they only append here, and the next ``assign`` takes the slots back under the lock.
        self._released: deque[tuple[int, ...]] = deque()
        self.writes = 0  # slots written since creation (a test and a metric: cold loads, not passes)
        self.pools = self._allocate(capacity, memory=0, classes=1, generation=0)
        self._free = list(range(capacity - 1, NULL_SLOT, -1))  # pop() hands out 1, 2, 3, ...

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Slots in use (the null slot not counted)."""
        return len(self._records)

    @property
    def generation(self) -> int:
        return self.pools.generation

    # -- assigning -----------------------------------------------------------------------------
    def assign(self, chains: list[tuple[PreparedAdapter, ...]]) -> tuple[list[int], SlotPools]:
        """The slot of each ``(adapter, *ancestors)`` chain, writing the ones that have none yet.

        Returns the slots and the pools they are valid in, read under one lock: a pass uses exactly
        these (later growth copies them into new tensors; these keep their contents)."""
        with self._lock:
            self._take_back_released()
            slots: list[int] = []
            missing: list[tuple[int, tuple[PreparedAdapter, ...]]] = []
            for chain in chains:
                slot = self._slot_of.get(_key(chain))
                if slot is None:
                    missing.append((len(slots), chain))
                    slot = NULL_SLOT  # filled below
                slots.append(slot)
            if missing:
                fresh: dict[tuple[int, ...], tuple[PreparedAdapter, ...]] = {}
                for _, chain in missing:  # the same adapter twice in one call: one slot
                    fresh.setdefault(_key(chain), chain)
                written = self._write(list(fresh.values()))
                for at, chain in missing:
                    slots[at] = written[_key(chain)]
            return slots, self.pools

    def slot_of(self, adapter: PreparedAdapter, ancestors: tuple[PreparedAdapter, ...] = ()) -> int | None:
        """The slot holding ``adapter`` (with these ancestors), or None."""
        return self._slot_of.get(_key((adapter, *ancestors)))

    def _write(self, chains: list[tuple[PreparedAdapter, ...]]) -> dict[tuple[int, ...], int]:
        """A slot for each chain, written: the pools grown once for all, then one write per group of
        chains of the same widths (installing 100,000 adapters is a few hundred writes, not millions)."""
        check_prepared_for([a for chain in chains for a in chain], self.device, self.dtype)
        sizes = [(sum(a.memory_keys.shape[2] for a in c), c[0].head_weight.shape[0]) for c in chains]
        memory, classes = max(m for m, _ in sizes), max(c for _, c in sizes)
        p = self.pools
        if len(self._free) < len(chains) or memory > p.memory or classes > p.classes:
            self._grow(memory=memory, classes=classes, slots=len(chains))
        groups: dict[tuple[int, int], list[int]] = {}
        for i, size in enumerate(sizes):
            groups.setdefault(size, []).append(i)
        written: dict[tuple[int, ...], int] = {}
        for (memory, classes), group in groups.items():
            for start in range(0, len(group), WRITE_CHUNK):  # the stacked copies stay small
                members = group[start : start + WRITE_CHUNK]
                picked = [self._free.pop() for _ in members]
                self._write_group([chains[i] for i in members], picked, memory, classes)
                written.update(self._record(chains, members, picked, memory, classes))
        self.writes += len(chains)
        return written

    def _record(self, chains, members, picked, memory, classes) -> dict[tuple[int, ...], int]:
        """Which adapter holds which slot, each slot handed back when its adapter is freed."""
        written = {}
        for i, slot in zip(members, picked, strict=True):
            chain = chains[i]
            key = _key(chain)
            self._slot_of[key] = slot
            self._records[slot] = _Slot(weakref.ref(chain[0]), chain[1:], classes, memory)
            weakref.finalize(chain[0], self._released.append, key)
            written[key] = slot
        return written

    def _write_group(
        self, chains: list[tuple[PreparedAdapter, ...]], slots: list[int], memory: int, classes: int
    ) -> None:
        p = self.pools
        index = torch.tensor(slots, device=self.device)
        # Pools are normal tensors written outside autograd, whether or not the caller runs in
        # inference mode (a pass assigns slots inside one, a server's install outside it).
        with torch.inference_mode(False), torch.no_grad():
            if memory:
                keys = torch.stack([_visible(c, "memory_keys") for c in chains], dim=1)
                values = torch.stack([_visible(c, "memory_values") for c in chains], dim=1)
                p.keys[:, index, :, :memory] = keys  # (L, n, H, m, d)
                p.values[:, index, :, :memory] = values
            p.keys[:, index, :, memory:] = 0
            p.values[:, index, :, memory:] = 0
            p.memory_bias[index, :memory] = 0
            p.memory_bias[index, memory:] = float("-inf")
            p.memory_length[index] = memory
            p.cls[index] = torch.stack([c[0].cls for c in chains])
            p.head_weight[index, :classes] = torch.stack([c[0].head_weight for c in chains])
            p.head_weight[index, classes:] = 0
            p.head_bias[index, :classes] = torch.stack([c[0].head_bias for c in chains])
            p.head_bias[index, classes:] = 0

    def _take_back_released(self) -> None:
        while self._released:
            key = self._released.popleft()
            slot = self._slot_of.pop(key, None)
            if slot is not None:
                del self._records[slot]
                self._free.append(slot)

    # -- growing -------------------------------------------------------------------------------
    def _grow(self, *, memory: int, classes: int, slots: int = 1) -> None:
        """Copy the pools into larger ones: room for ``slots`` more (doubling), ``memory``, ``classes``."""
        old = self.pools
        capacity = old.capacity
        while capacity - old.capacity + len(self._free) < slots:
            capacity *= 2
        # Memory and classes round up to powers of two: adapters of m = 1, 2, 3, 5 grow the pools
        # twice, not four times, and a pass narrowed to its own adapters' widths (``widths``)
        # always fits. Padding costs the Triton kernel nothing (it stops at each slot's length).
        memory = max(_power_of_2(memory), old.memory)
        classes = max(_power_of_2(classes), old.classes)
        new = self._allocate(capacity, memory=memory, classes=classes, generation=old.generation + 1)
        S, P, C = old.capacity, old.memory, old.classes
        with torch.inference_mode(False), torch.no_grad():
            new.keys[:, :S, :, :P] = old.keys
            new.values[:, :S, :, :P] = old.values
            new.memory_bias[:S, :P] = old.memory_bias
            new.memory_length[:S] = old.memory_length
            new.cls[:S] = old.cls
            new.head_weight[:S, :C] = old.head_weight
            new.head_bias[:S, :C] = old.head_bias
        self._free = list(range(capacity - 1, S - 1, -1)) + self._free
        self.pools = new

    def _allocate(self, capacity: int, *, memory: int, classes: int, generation: int) -> SlotPools:
        s = self.spec
        like = {"device": self.device, "dtype": self.dtype}
        memory_shape = (s.depth, capacity, s.num_heads, memory, s.head_dim)
        with torch.inference_mode(False):  # normal tensors, writable outside inference mode too
            return SlotPools(
                keys=torch.zeros(memory_shape, **like),
                values=torch.zeros(memory_shape, **like),
                memory_bias=torch.full((capacity, memory), float("-inf"), **like),
                memory_length=torch.zeros(capacity, device=self.device, dtype=torch.int32),
                cls=torch.zeros(capacity, s.width, **like),
                head_weight=torch.zeros(capacity, classes, s.width, **like),
                head_bias=torch.zeros(capacity, classes, **like),
                generation=generation,
            )


def _visible(chain: tuple[PreparedAdapter, ...], field: str) -> Tensor:
    """A chain's visible memory keys or values (L, H, m, d): its own, then its ancestors'."""
    return (
        getattr(chain[0], field) if len(chain) == 1 else torch.cat([getattr(a, field) for a in chain], dim=2)
    )


def _key(chain: tuple[PreparedAdapter, ...]) -> tuple[int, ...]:
    return tuple(id(a) for a in chain)


def widths(memory: int, classes: int) -> tuple[int, int]:
    """The (P, C) a pass reads for adapters of at most ``memory`` memory entries and ``classes``
    classes: powers of two, a function of those adapters alone (the pools always hold them)."""
    return _power_of_2(memory), _power_of_2(classes)


def _power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0
