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

Growing *ahead* keeps that capture off the passes' way (``grow_ahead``, ``publish``): the installing
thread grows the pools into new tensors that only it reads, writes its adapters there, captures what
passes will replay on them (a server's engine loop: server/inference/warmup.py), and then publishes
them; meanwhile every other thread's passes run on the published pools and their graphs, and a
write they make goes into both. Another thread that needs them (an adapter written only there, a
growth of its own) publishes them at once: a wait could deadlock (the captures wait for passes).

Writes run on the caller's thread and, on CUDA, on the device's current stream, which is the stream
passes run on: a slot freed after a pass was launched is rewritten only after that pass's kernels.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from ..sets.stack import PreparedAdapter, check_prepared_for
from ..weights.spec import ViTSpec
from .slot_pools import (
    SlotPools,
    allocate_pools,
    chain_sizes,
    copy_pools,
    power_of_2,
    widest,
    widths,
    write_slots,
)

__all__ = ["NULL_SLOT", "AdapterSlots", "SlotPools", "widths"]

log = logging.getLogger(__name__)
NULL_SLOT = 0
WRITE_CHUNK = 4096  # slots written per stacked copy (100,000 heads of ViT-B would stack 15 GB at once)

Chain = tuple[PreparedAdapter, ...]  # an adapter and its ancestors (extension mode), or itself alone


@dataclass(frozen=True, eq=False)
class _Slot:
    adapter: weakref.ref  # the adapter the slot holds
    ancestors: Chain  # kept alive while the slot is: their memory is in it
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
        # Filled by finalizers, which may run in any thread at any moment (garbage collection):
        # they only append here, and the next ``assign`` takes the slots back under the lock.
        self._released: deque[tuple[int, ...]] = deque()
        self.writes = 0  # slots written since creation (a test and a metric: cold loads, not passes)
        empty = {"memory": 0, "classes": 1, "generation": 0}
        self._published = allocate_pools(spec, self.device, dtype, capacity, **empty)
        self._free = list(range(capacity - 1, NULL_SLOT, -1))  # pop() hands out 1, 2, 3, ...
        # Growing ahead (``grow_ahead``): the pools grown and not yet published, the thread that grew
        # them (the only one that reads them), their free slots past the published capacity, and the
        # chains written into them alone.
        self._pending: SlotPools | None = None
        self._owner: int | None = None
        self._extra: list[int] = []
        self._unpublished: set[tuple[int, ...]] = set()

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Slots in use (the null slot not counted)."""
        return len(self._records)

    @property
    def pools(self) -> SlotPools:
        """The pools a pass reads: the published ones, or the pending ones for the thread growing
        them ahead (``grow_ahead``), which captures what passes will replay on them."""
        pending = self._pending
        if pending is not None and self._owner == threading.get_ident():
            return pending
        return self._published

    @property
    def generation(self) -> int:
        return self.pools.generation

    @property
    def growing_ahead(self) -> bool:
        """Whether pools grown ahead wait to be published."""
        return self._pending is not None

    # -- assigning -----------------------------------------------------------------------------
    def assign(self, chains: list[Chain]) -> tuple[list[int], SlotPools]:
        """The slot of each ``(adapter, *ancestors)`` chain, writing the ones that have none yet.

        Returns the slots and the pools they are valid in, read under one lock: a pass uses exactly
        these (later growth copies them into new tensors; these keep their contents). A call that
        needs pools another thread grows ahead publishes them first."""
        with self._lock:
            self._take_back_released()
            ahead = self._ahead()
            if not ahead and self._needs_pending(chains):
                self._publish()  # early: waiting could deadlock (the grower may wait for this thread)
            slots: list[int] = []
            missing: list[tuple[int, Chain]] = []
            for chain in chains:
                slot = self._slot_of.get(_key(chain))
                if slot is None:
                    missing.append((len(slots), chain))
                    slot = NULL_SLOT  # filled below
                slots.append(slot)
            if missing:
                fresh: dict[tuple[int, ...], Chain] = {}
                for _, chain in missing:  # the same adapter twice in one call: one slot
                    fresh.setdefault(_key(chain), chain)
                written = self._write(list(fresh.values()), ahead)
                for at, chain in missing:
                    slots[at] = written[_key(chain)]
            return slots, self.pools

    def slot_of(self, adapter: PreparedAdapter, ancestors: Chain = ()) -> int | None:
        """The slot holding ``adapter`` (with these ancestors), or None (also while it is written
        only into pools another thread grows ahead: ``assign`` then publishes them)."""
        key = _key((adapter, *ancestors))
        if self._unpublished and key in self._unpublished and not self._ahead():
            return None
        return self._slot_of.get(key)

    # -- growing ahead ---------------------------------------------------------------------------
    def grow_ahead(self, chains: list[Chain]) -> bool:
        """Grow the pools for ``chains`` (those without a slot) without publishing them: True when
        they must grow. This thread then reads the pending pools (``pools``) and writes its chains
        there (``assign``) until it calls ``publish``; other threads read the published ones."""
        with self._lock:
            if self._ahead():
                raise RuntimeError("this thread already grows the pools ahead: publish them first")
            if self._pending is not None:  # another thread's growth: published now, then this one
                self._publish()
            self._take_back_released()
            fresh = list({_key(c): c for c in chains if _key(c) not in self._slot_of}.values())
            if not fresh:
                return False
            memory, classes = widest(fresh)
            p = self._published
            if len(self._free) >= len(fresh) and memory <= p.memory and classes <= p.classes:
                return False
            self._owner = threading.get_ident()  # before the pools: ``pools`` reads in this order
            self._pending, self._extra = self._grown(p, len(self._free), memory, classes, len(fresh))
            return True

    def publish(self) -> None:
        """Make the pools this thread grew ahead the ones every pass reads (nothing if another
        thread needed them first and published them then)."""
        with self._lock:
            if self._ahead():
                self._publish()
            elif self._owner is not None or self._pending is not None:
                raise RuntimeError("another thread grows the pools ahead: it publishes them")

    def _publish(self) -> None:
        if self._owner != threading.get_ident():
            log.info("slot pools grown ahead published early: another thread's pass needed them")
        self._published = self._pending
        self._free = self._extra + self._free
        self._pending, self._owner, self._extra = None, None, []
        self._unpublished.clear()

    def _ahead(self) -> bool:
        return self._pending is not None and self._owner == threading.get_ident()

    def _needs_pending(self, chains: list[Chain]) -> bool:
        """Whether ``chains`` cannot be assigned before the pending pools are published: one is
        written only there, or those without a slot do not fit the published pools."""
        if self._pending is None:
            return False
        if self._unpublished and any(_key(c) in self._unpublished for c in chains):
            return True
        fresh = {_key(c): c for c in chains if _key(c) not in self._slot_of}
        if not fresh:
            return False
        memory, classes = widest(list(fresh.values()))
        p = self._published
        return len(self._free) < len(fresh) or memory > p.memory or classes > p.classes

    # -- writing -------------------------------------------------------------------------------
    def _write(self, chains: list[Chain], ahead: bool) -> dict[tuple[int, ...], int]:
        """A slot for each chain, written: the pools grown once for all, then one write per group of
        chains of the same widths (installing 100,000 adapters is a few hundred writes, not millions).
        ``ahead``: into the pending pools alone; else into the published ones (and any pending)."""
        check_prepared_for([a for chain in chains for a in chain], self.device, self.dtype)
        sizes = [chain_sizes(c) for c in chains]
        memory, classes = max(m for m, _ in sizes), max(c for _, c in sizes)
        p = self.pools
        free = len(self._free) + (len(self._extra) if ahead else 0)
        if free < len(chains) or memory > p.memory or classes > p.classes:
            grown, extra = self._grown(p, free, memory, classes, len(chains))
            if ahead:
                self._pending, self._extra = grown, extra + self._extra
            else:  # (no pending growth is under way: ``assign`` published it)
                self._published, self._free = grown, extra + self._free
        targets = [self._pending] if ahead else [self._published, self._pending]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, size in enumerate(sizes):
            groups.setdefault(size, []).append(i)
        written: dict[tuple[int, ...], int] = {}
        for (memory, classes), group in groups.items():
            for start in range(0, len(group), WRITE_CHUNK):  # the stacked copies stay small
                members = group[start : start + WRITE_CHUNK]
                picked = [self._take(ahead) for _ in members]
                for pools in targets:
                    if pools is not None:
                        write_slots(pools, [chains[i] for i in members], picked, memory, classes)
                written.update(self._record(chains, members, picked, memory, classes, ahead))
        self.writes += len(chains)
        return written

    def _take(self, ahead: bool) -> int:
        """A free slot: one the published pools have, else (growing ahead) one only the pending have."""
        return self._free.pop() if self._free or not ahead else self._extra.pop()

    def _record(self, chains, members, picked, memory, classes, ahead) -> dict[tuple[int, ...], int]:
        """Which adapter holds which slot, each slot handed back when its adapter is freed."""
        written = {}
        for i, slot in zip(members, picked, strict=True):
            chain = chains[i]
            key = _key(chain)
            self._slot_of[key] = slot
            self._records[slot] = _Slot(weakref.ref(chain[0]), chain[1:], classes, memory)
            weakref.finalize(chain[0], self._released.append, key)
            if ahead:
                self._unpublished.add(key)
            written[key] = slot
        return written

    def _take_back_released(self) -> None:
        while self._released:
            key = self._released.popleft()
            slot = self._slot_of.pop(key, None)
            self._unpublished.discard(key)
            if slot is not None:
                del self._records[slot]
                self._free.append(slot)

    # -- growing -------------------------------------------------------------------------------
    def _grown(
        self, old: SlotPools, free: int, memory: int, classes: int, slots: int
    ) -> tuple[SlotPools, list[int]]:
        """``old`` copied into larger pools: room for ``slots`` more than its ``free`` ones (doubling),
        ``memory``, ``classes``. Returns them and their new slots, free (pop() hands out the lowest)."""
        capacity = old.capacity
        while capacity - old.capacity + free < slots:
            capacity *= 2
        # Memory and classes round up to powers of two: adapters of m = 1, 2, 3, 5 grow the pools
        # twice, not four times, and a pass narrowed to its own adapters' widths (``widths``)
        # always fits. Padding costs the Triton kernel nothing (it stops at each slot's length).
        memory = max(power_of_2(memory), old.memory)
        classes = max(power_of_2(classes), old.classes)
        like = (self.spec, self.device, self.dtype)
        new = allocate_pools(*like, capacity, memory=memory, classes=classes, generation=old.generation + 1)
        copy_pools(old, new)
        return new, list(range(capacity - 1, old.capacity - 1, -1))


def _key(chain: Chain) -> tuple[int, ...]:
    return tuple(id(a) for a in chain)
