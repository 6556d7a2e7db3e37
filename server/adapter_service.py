"""Keeps the engine's live adapter set equal to the valid bundles in the store.

Local changes (POST/DELETE) validate completely, then persist, then swap, all under the engine's one
write lock (``MemoryViT.exclusive``), so a failure at any step leaves both the store and the live set
as they were, and no other writer can slip in between. Changes made by other
replicas sharing the store are picked up by ``sync``, which a background task calls every few
seconds (and every local change calls first). Invalid files are reported, never loaded, never fatal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from adapters import AdapterBundle, check_compatible, read_bundle
from memory_core import AdapterSet, MemoryViT, MemvitError, PreparedAdapter, UnknownAdapterError

from .store import AdapterStore, FileState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    state: FileState
    bundle: AdapterBundle
    prepared: PreparedAdapter


class AdapterService:
    def __init__(self, engine: MemoryViT, store: AdapterStore, *, max_bundle_bytes: int) -> None:
        self.engine = engine
        self.store = store
        self.max_bundle_bytes = max_bundle_bytes
        self._entries: dict[str, _Entry] = {}  # valid bundles, as last read from the store
        self._seen: dict[str, FileState] = {}  # every bundle file at the last sync, valid or not
        self.invalid: dict[str, str] = {}  # file name -> why it is not loaded

    # -- reading ----------------------------------------------------------------------------------
    def bundle(self, name: str) -> AdapterBundle:
        live = self.engine.adapters
        live[name]  # raises UnknownAdapterError
        return self._entries[name].bundle

    # -- changes ----------------------------------------------------------------------------------
    def register(self, data: bytes, *, replace: bool = False) -> tuple[AdapterBundle, AdapterSet]:
        """Validate a bundle completely, write it to the store, make it live. All or nothing."""
        bundle = read_bundle(data, max_bytes=self.max_bundle_bytes)
        check_compatible(bundle, self.engine)
        prepared = self.engine.prepare(bundle.weights)
        with self.engine.exclusive():
            self._sync_locked()  # another replica may have just added this bundle's parent
            new_set = self.engine.adapters.with_adapter(prepared, replace=replace)  # conflicts raise here
            state = self.store.write(bundle, replace=replace)
            live = self.engine.install(new_set)
            self._entries[bundle.name] = _Entry(state, bundle, prepared)
            self._seen[bundle.name] = state
            self.invalid.pop(bundle.name, None)
        log.info("registered adapter %s (set v%d)", bundle.name, live.version)
        return bundle, live

    def delete(self, name: str) -> AdapterSet:
        with self.engine.exclusive():
            self._sync_locked()
            new_set = self.engine.adapters.without(name)  # unknown or still extended: raises here
            self.store.delete(name)
            live = self.engine.install(new_set)
            self._entries.pop(name, None)
            self._seen.pop(name, None)
        log.info("deleted adapter %s (set v%d)", name, live.version)
        return live

    def sync(self) -> bool:
        """Bring the live set in line with the store. Returns True if it changed."""
        with self.engine.exclusive():
            return self._sync_locked()

    def _sync_locked(self) -> bool:
        files = self.store.scan()
        if files == self._seen:
            return False
        entries: dict[str, _Entry] = {}
        invalid: dict[str, str] = {}
        for name, state in files.items():
            entry = self._entries.get(name)
            if entry is not None and entry.state == state:
                entries[name] = entry
                continue
            try:
                entries[name] = self._read(name, state)
            except (MemvitError, OSError) as exc:
                invalid[name] = str(exc)
                if self.invalid.get(name) != str(exc):
                    log.warning("adapter store: not loading %s: %s", name, exc)
        ordered = _parents_first(entries, invalid, self.engine.adapters.names)
        self._entries = {e.bundle.name: e for e in ordered}
        self._seen, self.invalid = files, invalid
        current = self.engine.adapters
        if [a.prepared for a in ordered] == list(current.adapters):
            return False
        live = self.engine.install(AdapterSet(tuple(e.prepared for e in ordered)))
        added = sorted(set(live.names) - set(current.names))
        removed = sorted(set(current.names) - set(live.names))
        log.info("adapter store changed: +%s -%s (set v%d, %d live)", added, removed, live.version, len(live))
        return True

    def _read(self, name: str, state: FileState) -> _Entry:
        bundle = read_bundle(self.store.path(name), max_bytes=self.max_bundle_bytes)
        if bundle.name != name:
            raise UnknownAdapterError(
                f"{name}.safetensors holds adapter {bundle.name!r}; file names must match"
            )
        check_compatible(bundle, self.engine)
        return _Entry(state, bundle, self.engine.prepare(bundle.weights))


def _parents_first(
    entries: dict[str, _Entry], invalid: dict[str, str], order: tuple[str, ...]
) -> list[_Entry]:
    """Entries with every parent before its extensions; those whose parent is missing go to ``invalid``.

    Adapters already live keep their order; new ones follow by name.
    """
    rank = {name: i for i, name in enumerate(order)}
    pending = sorted(entries, key=lambda n: (rank.get(n, len(rank)), n))
    placed: list[_Entry] = []
    names: set[str] = set()
    progress = True
    while pending and progress:
        progress = False
        for name in list(pending):
            parent = entries[name].bundle.weights.parent
            if parent is None or parent in names:
                placed.append(entries[name])
                names.add(name)
                pending.remove(name)
                progress = True
    for name in pending:
        parent = entries[name].bundle.weights.parent
        invalid[name] = f"extends {parent!r}, which is not a valid bundle in the store"
    return placed
