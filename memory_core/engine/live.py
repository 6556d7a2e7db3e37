"""The live adapter set of one engine: the snapshot passes read, and the one way it changes.

``LiveAdapters`` owns three things and nothing else: the current immutable ``AdapterSet`` (readers
never lock: a pass reads ``current`` once and keeps that object), the one write lock that orders
every change, and ``install``, the swap, which also writes each new adapter into the engine's device
slots (memory_core/routing/slots.py). The server's adapter registry and the command line hold one;
the engine (``MemoryViT``) knows nothing of it: it prepares adapters and runs whichever snapshot it
is handed.

Moving the engine to another device or dtype goes through ``move_to``, which moves it and
re-prepares the live adapters for it as one change under the lock. Moving the bare engine
(``engine.to(...)``) moves the base only; the live set is then stale, and both ``install`` and the
fused pass refuse adapters prepared for another device or dtype with an error that says so, so a
stale adapter is never used silently.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from ..routing.slot_table import table_of
from ..sets.adapter_set import AdapterSet
from ..sets.stack import check_prepared_for
from ..weights.adapter import AdapterWeights
from .model import MemoryViT

log = logging.getLogger(__name__)


class LiveAdapters:
    """The adapters ``engine`` serves now: an immutable snapshot, swapped whole under one lock."""

    def __init__(self, engine: MemoryViT) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self._current = AdapterSet()
        # The engine's device and dtype that ``_current``'s adapters were checked against.
        self._checked_for: tuple[torch.device, torch.dtype] | None = None
        # Called on the installing thread when an install must grow the slot pools, before passes
        # read them, with the set about to go live: its passes run on the grown pools (a server
        # captures their graphs here: server/inference/engine_loop.py). None: grown on the spot.
        self.on_growth: Callable[[AdapterSet], None] | None = None

    @property
    def current(self) -> AdapterSet:
        """The live snapshot. Read it once per pass (or per batch) and use that object throughout."""
        return self._current

    def __repr__(self) -> str:
        return f"LiveAdapters({self._current!r})"

    @contextmanager
    def exclusive(self) -> Iterator[AdapterSet]:
        """Hold the write lock and yield the live set: read, derive, persist and ``install`` atomically.

        The one lock that orders every change to the live set (the adapter registry runs its store
        writes under it too). Re-entrant. Passes never take it.
        """
        with self._lock:
            yield self._current

    def install(self, adapter_set: AdapterSet) -> AdapterSet:
        """Make ``adapter_set`` live: the one way the live set changes. Returns it.

        Its adapters must have been prepared by the engine on its current device and dtype. Each
        adapter new to the live set is written into a device slot of the engine here, so passes find
        it there. Passes in flight keep the set they started with; every later pass sees the new one.
        """
        target = (self.engine.device, self.engine.dtype)
        with self._lock:
            # Adapters of the live set were checked when it was installed; while the engine has not
            # moved since, only the new ones need checking. Linear in the set's size either way, but
            # a set lookup instead of a device comparison: 0.2 ms instead of 3.5 ms at 5,000 resident,
            # paid on every cold load of a server's resident set.
            known = {id(a) for a in self._current.adapters} if self._checked_for == target else set()
            fresh = [a for a in adapter_set.adapters if id(a) not in known]
            check_prepared_for(fresh, *target)
            # Each new adapter gets its device slot now, on the installing thread, so that passes
            # never pay for the copy (memory_core/routing/slots.py); a slot is freed with its adapter.
            chains = [tuple(adapter_set[n] for n in adapter_set.lineage(a.name)) for a in fresh]
            self._assign(adapter_set, chains)
            self._current = adapter_set  # one reference assignment
            self._checked_for = target
        # Debug, not info: a server swaps the set on every cold load and eviction (many per second
        # under skewed traffic); its registry logs the changes that matter.
        if log.isEnabledFor(logging.DEBUG):
            names = adapter_set.names
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            log.debug("adapter set v%d live: [%s]", adapter_set.version, shown)
        return adapter_set

    def _assign(self, adapter_set: AdapterSet, chains: list[tuple]) -> None:
        """Slots for ``chains`` and the set's slot table (memory_core/routing/slot_table.py), so that
        no pass builds it. When the pools must grow and ``on_growth`` is set, they grow ahead: this
        thread writes and runs ``on_growth`` on the grown pools while passes read the old ones, then
        publishes them (an ``on_growth`` that fails costs its captures, not the install)."""
        slots, hook = self.engine.slots, self.on_growth
        ahead = hook is not None and self.engine.graphed and slots.grow_ahead(chains)
        try:
            slots.assign(chains)  # (grown ahead: into the pending pools, which this thread reads)
            table_of(adapter_set, slots)
            if ahead:
                try:
                    with self.engine.capturing_for_pending_pools():
                        hook(adapter_set)
                except Exception:
                    log.exception("preparing the grown slot pools' passes failed: they run unprepared")
        finally:
            if ahead:
                slots.publish()

    # Conveniences over ``install``: each derives the new set from the live one under the lock.
    def add(self, weights: AdapterWeights, *, replace: bool = False) -> AdapterSet:
        """Make ``weights`` live. Returns the new set; on any error the live set is unchanged."""
        prepared = self.engine.prepare(weights)  # outside the lock: it is the slow part
        with self.exclusive() as live:
            return self.install(live.with_adapter(prepared, replace=replace))

    def remove(self, name: str) -> AdapterSet:
        """Take ``name`` out of the live set (refused while live adapters extend it)."""
        with self.exclusive() as live:
            return self.install(live.without(name))

    def replace_all(self, weights: Iterable[AdapterWeights]) -> AdapterSet:
        """Replace the whole live set at once (parents must come before their extensions)."""
        return self.install(self.engine.prepare_set(weights))

    def move_to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> AdapterSet:
        """Move the engine to ``device``/``dtype`` and re-prepare the live adapters for it.

        One change under the write lock, so no writer installs a set prepared for the old device in
        between. The new set keeps the old one's version: it holds the same adapters. Do not move
        an engine while passes run on it (``nn.Module.to`` changes its parameters in place).
        """
        with self.exclusive() as live:
            self.engine.to(device=device, dtype=dtype)
            moved = self.engine.prepare_set([a.weights for a in live], version=live.version)
            return self.install(moved)
