"""The catalog: every registered adapter, cheaply (names, keys, hashes, labels; no tensors).

It replays the store's journal (server/store/journal.py) over its index: ``open`` reads the index
(or migrates a store written before the journal, once) and the entries written since; ``refresh``
reads the entries written since the last call (an idle one is one GET of the next slot, a 404);
``commit`` claims the next slot for a change, re-checking it against every change that won a slot
first. ``on_change`` hears every change applied, in order, whoever wrote it.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..store import AdapterStore, StoreUnavailableError
from ..store.entries import Entry, JournalDamagedError, Snapshot
from ..store.journal import COMPACT_EVERY, Journal
from ..store.migrate import Validate, legacy_snapshot

log = logging.getLogger(__name__)
_COMMIT_ATTEMPTS = 100
LOOKUP_REFRESH_SECONDS = 0.05  # unknown names refresh the catalog at most this often


@dataclass(frozen=True)
class Change:
    generation: int
    entry: Entry
    before: Entry | None  # what the name held before (None: nothing)


class Catalog:
    def __init__(
        self,
        store: AdapterStore,
        *,
        on_change: Callable[[Change], None] | None = None,
        compact_every: int = COMPACT_EVERY,
    ) -> None:
        self.store = store
        self.journal = Journal(store)
        self.on_change = on_change
        self.compact_every = compact_every
        self.state = Snapshot()
        self._names: list[str] = []  # registered names, sorted: pages without sorting 100,000 names
        self.damaged: str | None = None  # why the journal cannot be followed past the head, if so
        self._lock = threading.RLock()
        self._looked_up_at = 0.0  # the last refresh for a name not found (polls do not count)

    # -- reading -----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The journal's head: the number of changes applied. Equal versions, equal registries."""
        return self.state.generation

    def __len__(self) -> int:
        return len(self.state.adapters)

    def __contains__(self, name: object) -> bool:
        return name in self.state.adapters

    def get(self, name: str) -> Entry | None:
        return self.state.adapters.get(name)

    @property
    def invalid(self) -> dict[str, str]:
        """Objects that are not valid bundles, by key (found by the migration)."""
        return self.state.invalid

    def page(self, after: str | None, limit: int) -> list[Entry]:
        """Up to ``limit`` registered adapters by name, after ``after``. Reads no bundle.

        Without the lock (the event loop calls it, and a refresh may hold the lock through a store
        request): a slice of a list is atomic, and a name deleted in between is left out."""
        names = self._names
        start = 0 if after is None else bisect.bisect_right(names, after)
        adapters = self.state.adapters
        return [e for n in names[start : start + limit] if (e := adapters.get(n)) is not None]

    def lineage(self, name: str) -> list[str]:
        """``name`` and its registered ancestors, nearest first."""
        chain = [name]
        while (entry := self.get(chain[-1])) is not None and entry.parent is not None:
            chain.append(entry.parent)
        return chain

    # -- following the journal ---------------------------------------------------------------------
    def open(self, validate: Validate, *, max_bytes: int) -> None:
        """Start-up: the index and the entries after it; a store without an index is migrated first."""
        with self._lock:
            repair = False
            try:
                snapshot = self.journal.read_index()
            except JournalDamagedError as exc:
                log.error("%s; rebuilding the registry from the journal's base and every entry", exc)
                snapshot, repair = None, True
            if snapshot is None:
                base = self.journal.read_base()
                if base is None:  # a new store, or one written before the journal: once in its life
                    base = self.journal.create_base(
                        legacy_snapshot(self.store, validate, max_bytes=max_bytes)
                    )
                snapshot = base
            self.state = snapshot
            self._names = sorted(snapshot.adapters)
            applied = self._tail()
            if repair or self.journal.index_generation < 0 or len(applied) >= 2 * self.compact_every:
                self.journal.save_index(self.state)

    def refresh(self) -> list[Change]:
        """Apply the entries written since the last call (each heard by ``on_change``)."""
        with self._lock:
            return self._tail()

    def refresh_for_lookup(self) -> None:
        """A refresh for a name not found (another replica may have registered it a moment ago):
        single flight, and at most one per ``LOOKUP_REFRESH_SECONDS``, so a flood of unknown names
        costs the store one GET per interval, not one per request."""
        with self._lock:  # callers that queued behind one refresh find it recent and share it
            if time.monotonic() - self._looked_up_at >= LOOKUP_REFRESH_SECONDS:
                self._tail()
                self._looked_up_at = time.monotonic()

    def commit(self, build: Callable[[Snapshot], Entry]) -> Change:
        """Journal one change. ``build`` checks it against the registry and returns its entry (or
        raises, and nothing is written); it runs again, against the new state, each time another
        writer wins the slot first, so a change is always checked against the state it follows."""
        with self._lock:
            self._tail()
            for _ in range(_COMMIT_ATTEMPTS):
                if self.damaged is not None:
                    raise JournalDamagedError(f"{self.damaged}; changes are refused until it is repaired")
                entry = build(self.state)
                generation = self.state.generation + 1
                if self.journal.claim(generation, entry):
                    change = self._apply(generation, entry)
                    if generation % self.compact_every == 0:  # the writer of every Nth change
                        self.journal.save_index(self.state)
                    return change
                self._tail()  # the winner's entry, and any after it; then check the change again
        raise StoreUnavailableError(f"{self.store.location}: too much contention for the journal")

    def _tail(self) -> list[Change]:
        applied = []
        while True:
            generation = self.state.generation + 1
            try:
                entry = self.journal.read_entry(generation)
            except JournalDamagedError as exc:
                # Never skipped: the replicas would no longer agree on what a version holds.
                if self.damaged != str(exc):
                    log.error("%s; serving what is known, refusing changes until it is repaired", exc)
                self.damaged = str(exc)
                break
            if entry is None:
                if self.damaged is not None:
                    log.warning("the journal can be followed again past change %d", generation - 1)
                    self.damaged = None
                break
            applied.append(self._apply(generation, entry))
        return applied

    def _apply(self, generation: int, entry: Entry) -> Change:
        before = self.state.apply(generation, entry)
        name = entry.name
        if entry.op == "put" and before is None:
            bisect.insort(self._names, name)
        elif entry.op == "delete" and before is not None:
            del self._names[bisect.bisect_left(self._names, name)]
        change = Change(generation, entry, before)
        if self.on_change is not None:
            self.on_change(change)
        return change
