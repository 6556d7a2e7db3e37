"""The adapter registry: every registered adapter (the catalog), and the few resident in memory.

Registered is not resident. The catalog (catalog.py) follows the store's journal and knows every
adapter cheaply; the resident set (resident.py) holds the prepared tensors of a bounded, recently
used few, the live set the passes read. A request's adapters are made resident on demand
(``acquire``), validated exactly as at registration.

Local changes (POST/DELETE) validate completely, then write, then journal, all under the live set's
one write lock (``LiveAdapters.exclusive``), so a refusal at any step leaves the store, the catalog
and the live set as they were, and no other writer in this process slips in between. Other
replicas' changes arrive through ``sync`` (a background task calls it every few seconds): it reads
the journal entries written since, and evicts resident adapters they replaced or deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from memvit.adapters import AdapterBundle, check_compatible, read_bundle
from memvit.memory_core import (
    AdapterInUseError,
    DuplicateAdapterError,
    LiveAdapters,
    MemvitError,
    UnknownAdapterError,
)

from ..store import AdapterStore, Entry, Snapshot, StoreUnavailableError, key_of
from ..store.base import legacy_name
from ..store.entries import dependents
from ..store.journal import new_entry
from ..telemetry.metrics import Metrics
from .bundles import check_put, entry_for, resident_bytes
from .catalog import Catalog, Change
from .loader import BundleLoader
from .reads import CatalogReads, RegistryInfo
from .resident import Pin, Resident, ResidentSet

log = logging.getLogger(__name__)


class AdapterRegistry(CatalogReads):
    def __init__(
        self,
        live: LiveAdapters,
        store: AdapterStore,
        *,
        max_bundle_bytes: int,
        resident_adapters: int = 1024,
        resident_bytes: int | None = None,
        max_tasks: int = 64,
        metrics: Metrics | None = None,
    ) -> None:
        self.live = live
        self.engine = live.engine  # validates and prepares bundles; ``live`` holds what it serves
        self.store = store
        self.max_bundle_bytes = max_bundle_bytes
        self.max_tasks = max_tasks  # adapters one request may ask for (unfiltered: the whole registry)
        self.catalog = Catalog(store, on_change=self._on_change)
        self.loader = BundleLoader(
            self.catalog, self.engine, max_bytes=max_bundle_bytes, catch_up=self._catch_up
        )
        self.resident = ResidentSet(
            live,
            load=self.loader.load,
            current=self.catalog.get,
            version=lambda: self.catalog.version,
            max_adapters=resident_adapters,
            max_bytes=resident_bytes,
            workers=store.read_parallelism,
            metrics=metrics,
        )
        self._counts: dict[int, int] = {}  # recent versions -> adapters registered then
        self._closures: tuple[int, dict] = (-1, {})  # a version, and closures at it

    # -- reading -----------------------------------------------------------------------------------

    def training(self, name: str) -> dict[str, Any] | None:
        """The ``training`` metadata of ``name``'s bundle: from its resident copy, or read from the
        store (only ``GET /adapters/{name}`` asks; the catalog does not carry it)."""
        entry = self.get(name)
        resident = self.resident.get(name)
        if resident is not None and resident.entry.key == entry.key:
            return resident.bundle.training
        return self.loader.training(entry)

    @property
    def invalid(self) -> dict[str, str]:
        """Store objects that are not served here, by adapter name, and why."""
        found = {legacy_name(key) or key: why for key, why in self.catalog.invalid.items()}
        found.update({name: why for name, (_, why) in self.loader.failed.items()})
        return found

    def closure(self, names: Iterable[str]) -> tuple[str, ...]:
        """``names`` with their registered ancestors, each parent before its extensions (remembered
        per version for the requests asking the same)."""
        key = names if isinstance(names, tuple) else tuple(names)
        if self._closures[0] != self.catalog.version:
            self._closures = (self.catalog.version, {})
        found = self._closures[1].get(key)
        if found is None:
            ordered: dict[str, None] = {}
            for name in key:
                for member in reversed(self.catalog.lineage(name)):
                    ordered.setdefault(member, None)
            found = tuple(ordered)
            if len(self._closures[1]) < 4096:
                self._closures[1][key] = found
        return found

    # -- requests ----------------------------------------------------------------------------------
    def acquire(self, names: Iterable[str], *, optional: bool = False) -> Pin:
        """Make ``names`` (and their ancestors) resident and pin them; blocks while loading."""
        return self.resident.acquire(self.closure(names), optional=optional)

    async def acquire_async(self, names: Iterable[str], *, optional: bool = False) -> Pin:
        return await self.resident.acquire_async(self.closure(names), optional=optional)

    def acquire_then(
        self, names: Iterable[str], then: Callable[[Pin | BaseException], None], *, optional: bool = False
    ) -> None:
        """``acquire`` without waiting: ``then(pin)`` or ``then(error)`` once loaded (ResidentSet)."""
        self.resident.acquire_then(self.closure(names), optional=optional, then=then)

    def lookup_refresh(self) -> None:
        """Catch up with the journal before calling a name unknown (rate-limited, single flight)."""
        with self.live.exclusive():
            self.catalog.refresh_for_lookup()
            self._stamp()

    # -- changes -----------------------------------------------------------------------------------
    def open(self) -> None:
        """Start-up: the catalog from the index and the journal (migrating an older store once)."""
        with self.live.exclusive():
            self.catalog.open(self.loader.validate_legacy, max_bytes=self.max_bundle_bytes)
            self._stamp()

    def sync(self) -> bool:
        """A poll: the journal entries written since the last one. Returns True if there were any."""
        with self.live.exclusive():
            changes = self.catalog.refresh()
            self._stamp()
        if changes:
            log.info("adapter registry: %d change(s) from the store, v%d, %d registered",
                     len(changes), self.catalog.version, len(self.catalog))  # fmt: skip
        return bool(changes)

    def register(
        self,
        data: bytes,
        *,
        replace: bool = False,
        authorize: Callable[[AdapterBundle], None] | None = None,
        parsed: AdapterBundle | None = None,
    ) -> tuple[Entry, RegistryInfo, bool]:
        """Validate a bundle completely, write it, journal it, make it resident. All or nothing.

        ``authorize`` sees the parsed bundle before anything is prepared or written, and raises to
        refuse it (a tenant's key that does not cover its name). ``parsed`` is ``data`` already read
        by ``read_bundle`` (an API process parsed it to authorize it: server/frontend/remote.py), so
        a registration parses its bundle once; everything after the parse (compatibility, the
        registry's checks) is done here either way. Returns the entry registered under that name
        after the change (this bundle, unless another replica replaced it in the moment between),
        the registry, and whether a registered adapter of that name was replaced.
        """
        bundle = parsed if parsed is not None else read_bundle(data, max_bytes=self.max_bundle_bytes)
        if authorize is not None:
            authorize(bundle)
        check_compatible(bundle, self.engine)
        prepared = self.engine.prepare(bundle.weights)
        name, journal = bundle.name, self.catalog.journal
        with self.live.exclusive():
            self.catalog.refresh()  # another replica may have just added this bundle's parent
            check_put(self.catalog.state, bundle, replace)  # refused before anything is written
            key, sha256 = journal.put_bundle(name, data)

            def build(state: Snapshot) -> Entry:
                check_put(state, bundle, replace)  # again, after each change that won a slot first
                return entry_for(bundle, key, sha256, len(data))

            try:
                change = self.catalog.commit(build)
            except MemvitError as exc:
                if not isinstance(exc, StoreUnavailableError):  # refused: the object is nobody's
                    journal.collect(key)
                raise
            if change.before is not None:
                journal.collect(change.before.key)
            resident = Resident(change.entry, bundle, prepared, resident_bytes(bundle, prepared))
            self.resident.install(resident, required=False)  # skipped if everything is in use
            self.catalog.refresh()  # a replace landing just after ours is what is registered now
            self._stamp()
            current = self.catalog.get(name) or change.entry
            info = self.info()
        log.info("registered adapter %s (v%d)", name, info.version)
        return current, info, change.before is not None

    def delete(self, name: str) -> RegistryInfo:
        """Journal the deletion of ``name`` (or of the invalid object listed under it)."""
        with self.live.exclusive():
            self.catalog.refresh()

            def build(state: Snapshot) -> Entry:
                entry = state.adapters.get(name)
                if entry is None:
                    if key_of(name) in state.invalid:  # an invalid object can always be deleted
                        return new_entry("delete", name, key=key_of(name))
                    raise UnknownAdapterError(f"no adapter named {name!r} is registered", field="name")
                if users := sorted(dependents(state.adapters, name)):
                    raise AdapterInUseError(
                        f"cannot remove {name!r}: {users} extend it; remove them first", field="name"
                    )
                return new_entry("delete", name, key=entry.key)

            change = self.catalog.commit(build)
            self.catalog.journal.collect(change.entry.key)
            self._stamp()
            info = self.info()
        log.info("deleted adapter %s (v%d)", name, info.version)
        return info

    def seed_once(self, bundles: Mapping[str, Path]) -> bool:
        """Give a brand-new store its first adapters, once in its life (through the journal).

        The replica that creates the store's seeded marker seeds, and only if the registry is empty:
        deleting the seeded adapters is never undone by a restart or by another replica. A crash
        half-way leaves some seed adapters missing, never deleted ones back.
        """
        empty = len(self.catalog) == 0 and not self.catalog.invalid
        if not self.store.mark_seeded(empty):
            return False
        for source in bundles.values():
            try:
                self.register(source.read_bytes())
            except DuplicateAdapterError:
                continue
        return True

    def close(self) -> None:
        self.resident.close()

    # -- inside ------------------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        """Every change applied to the catalog (ours and other replicas'), under the live set's lock."""
        name = change.entry.name
        self.loader.failed.pop(name, None)
        if name in self.resident:
            if change.entry.op == "delete":
                self.resident.remove(name)
            else:
                self.resident.outdated(name)

    def _stamp(self) -> None:
        """The live set carries the registry's version (its generation): one number everywhere."""
        version = self.catalog.version
        self._counts[version] = len(self.catalog)
        while len(self._counts) > 256:
            del self._counts[next(iter(self._counts))]
        live = self.live.current
        if live.version != version:
            self.live.install(live.at_version(version))

    def _catch_up(self) -> None:
        with self.live.exclusive():
            self.catalog.refresh()
            self._stamp()
