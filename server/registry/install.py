"""Changing what is resident: a loaded adapter installed (evicting, least recently used first, the
unpinned adapters that make room), one removed, one marked outdated by a replacement.

The writing half of ``ResidentSet`` (resident.py, which holds the state and the pins, and loads on
demand): every change takes the live set's exclusive lock, then the set's own bookkeeping lock, and
counts in ``_changes`` so that pinned groups notice.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from memvit.adapters import AdapterBundle
from memvit.memory_core import LiveAdapters, PreparedAdapter

from ..errors import ResidentSetFullError, TooManyTasksError
from ..store import Entry
from .eviction import SegmentedLRU

log = logging.getLogger("memvit.server.registry.resident")  # one logger for the resident set


@dataclass(frozen=True, eq=False)
class Resident:
    """A registered adapter, validated and prepared: the bundle its catalog entry names."""

    entry: Entry
    bundle: AdapterBundle
    prepared: PreparedAdapter
    nbytes: int  # what holding it costs: prepared tensors plus the weights kept to describe it


class Installing:
    """``ResidentSet``'s changes; the attributes are ``ResidentSet.__init__``'s."""

    live: LiveAdapters
    max_adapters: int
    max_bytes: int | None
    _current: Callable[[str], Entry | None]
    _version: Callable[[], int]
    _resident: dict[str, Resident]
    _order: SegmentedLRU
    _pins: Counter[str]
    _stale: set[str]
    _changes: int
    _bytes: int
    _lock: threading.Lock

    def _gauges(self) -> None:  # ResidentSet's
        raise NotImplementedError

    def install(self, resident: Resident, *, required: bool) -> bool:
        """Make ``resident`` live, evicting the least recently used unpinned adapters if needed.

        False when the catalog no longer names this entry (replaced or deleted while it loaded), or,
        unless ``required``, when nothing can be evicted. ``required`` (a request waits for it):
        raises ``ResidentSetFullError`` instead.
        """
        name = resident.entry.name
        with self.live.exclusive() as live:
            current = self._current(name)
            if current is None or current.key != resident.entry.key:
                return False
            parent = resident.entry.parent
            if parent is not None and parent not in live:
                if required:  # its requester pinned it: only a deletion can have taken it
                    raise ResidentSetFullError(f"cannot load adapter {name!r}: its parent {parent!r} left")
                return False
            if self.max_bytes is not None and resident.nbytes > self.max_bytes:
                if required:  # no eviction can make room: a limit of this server's, not a busy moment
                    raise TooManyTasksError(
                        f"adapter {name!r} needs {resident.nbytes:,} bytes resident; this server holds "
                        f"at most {self.max_bytes:,} (MEMVIT_RESIDENT_BYTES)",
                        field="tasks",
                    )
                return False
            with self._lock:
                replacing = self._resident.get(name)
                victims = self._victims(resident, replacing)
                if victims is None:
                    if required:
                        raise ResidentSetFullError(
                            f"cannot load adapter {name!r}: every resident adapter is in use by a queued "
                            f"request ({len(self._resident)} of {self.max_adapters}); retry shortly"
                        )
                    return False
            adapter_set = live
            for victim in victims:
                adapter_set = adapter_set.without(victim)
            adapter_set = adapter_set.with_adapter(resident.prepared, replace=replacing is not None)
            self.live.install(adapter_set.at_version(self._version()))
            with self._lock:
                for victim in victims:
                    self._forget(victim)
                held = self._resident.pop(name, None)
                self._bytes += resident.nbytes - (held.nbytes if held is not None else 0)
                self._resident[name] = resident
                self._stale.discard(name)
                self._order.add(name)
                self._changes += 1
        if victims:
            log.debug("evicted %s to load %s", victims, name)
        self._gauges()
        return True

    def _victims(self, resident: Resident, replacing: Resident | None) -> list[str] | None:
        """Probation then protected, least recently used first: unpinned adapters no resident
        adapter extends (lock held). None when evicting all of those would not make room."""
        count = len(self._resident) + (replacing is None)
        nbytes = self._bytes + resident.nbytes - (replacing.nbytes if replacing else 0)
        # Parents of resident adapters stay (an extension needs its parent), the new one's included.
        parents = {r.entry.parent for r in (*self._resident.values(), resident) if r.entry.parent is not None}
        victims = []
        for name in self._order:
            held = self._resident[name]
            if count <= self.max_adapters and (self.max_bytes is None or nbytes <= self.max_bytes):
                return victims
            if name == resident.entry.name or self._pins[name] > 0 or name in parents:
                continue
            victims.append(name)
            count -= 1
            nbytes -= held.nbytes
        fits = count <= self.max_adapters and (self.max_bytes is None or nbytes <= self.max_bytes)
        return victims if fits else None

    def remove(self, name: str) -> None:
        """Take ``name`` out (deleted from the registry, or its resident copy outdated), pinned or not:
        a request waiting for a deleted adapter is answered "removed while the request waited"."""
        with self.live.exclusive() as live:
            if name not in live:
                return
            self.live.install(live.without(name).at_version(self._version()))
            with self._lock:
                self._forget(name)
        self._gauges()

    def outdated(self, name: str) -> None:
        """The registry replaced ``name``: drop the resident copy, or (while a request holds it)
        keep it for that request and load the new one when ``name`` is next asked for."""
        if name not in self._resident:
            return
        with self._lock:
            if self._pins[name] > 0:
                self._stale.add(name)
                self._changes += 1
                return
        self.remove(name)

    def _forget(self, name: str) -> None:
        self._changes += 1
        self._order.forget(name)
        held = self._resident.pop(name, None)
        if held is not None:
            self._bytes -= held.nbytes
        self._stale.discard(name)
