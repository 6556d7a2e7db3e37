"""Keeps the live adapter set equal to the valid bundles in the store.

Local changes (POST/DELETE) validate completely, then persist, then re-read the store's state, all
under the live set's one write lock (``LiveAdapters.exclusive``), so a failure at any step leaves both
the store and the live set as they were, and no other writer in this process can slip in between.
Changes made by other replicas sharing the store are picked up by ``sync``, which a background task
calls every few seconds (and every local change calls before and after its write).

The live set's version is the store's generation read before the listing it was built from, so it
only grows and replicas serving one state report one number. A bundle is read only when its
version (ETag, or inode/size/mtime) differs from the one last read: a poll that finds nothing
changed reads no bundle. Invalid objects are reported under ``invalid``, never loaded, never fatal.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from adapters import AdapterBundle, check_compatible, read_bundle
from memory_core import AdapterSet, LiveAdapters, MemvitError, PreparedAdapter, UnknownAdapterError

from .store import AdapterStore, ObjectVersion, StoreUnavailableError

log = logging.getLogger(__name__)
_REFUSALS_LOGGED = 20  # per sync; the rest are counted in one line


@dataclass(frozen=True)
class StoredAdapter:
    """A valid bundle as read from the store: its version there, its content hash, and its engine form."""

    version: ObjectVersion
    sha256: str
    bundle: AdapterBundle
    prepared: PreparedAdapter


class AdapterRegistry:
    def __init__(
        self,
        live: LiveAdapters,
        store: AdapterStore,
        *,
        max_bundle_bytes: int,
        read_workers: int | None = None,
    ) -> None:
        self.live = live
        self.engine = live.engine  # validates and prepares bundles; ``live`` holds what it serves
        self.store = store
        self.max_bundle_bytes = max_bundle_bytes
        self.read_workers = read_workers or store.read_parallelism
        self._valid: dict[str, StoredAdapter] = {}  # every valid bundle read, parent present or not
        self._failed: dict[str, tuple[ObjectVersion, str]] = {}  # bundles that failed to read, and why
        self._seen: dict[str, ObjectVersion] | None = None  # the listing at the last sync
        self._generation = -1
        self.invalid: dict[str, str] = {}  # name -> why it is not loaded
        self._refusals = 0

    # -- reading ----------------------------------------------------------------------------------
    def get(self, name: str) -> StoredAdapter:
        """The live adapter ``name`` (UnknownAdapterError when it is not live)."""
        self.live.current[name]  # raises UnknownAdapterError
        return self._valid[name]

    # -- changes ----------------------------------------------------------------------------------
    def register(
        self, data: bytes, *, replace: bool = False, authorize: Callable[[AdapterBundle], None] | None = None
    ) -> tuple[StoredAdapter, AdapterSet]:
        """Validate a bundle completely, write it to the store, make it live. All or nothing.

        ``authorize`` is called with the parsed bundle before anything else is done with it, and
        refuses it by raising (the caller's key does not cover its name).
        Returns the adapter now live under that name (this bundle, unless another replica replaced
        it in the moment between) and the live set.
        """
        bundle = read_bundle(data, max_bytes=self.max_bundle_bytes)
        if authorize is not None:
            authorize(bundle)
        check_compatible(bundle, self.engine)
        prepared = self.engine.prepare(bundle.weights)
        name = bundle.name
        with self.live.exclusive():
            self._sync_locked()  # another replica may have just added this bundle's parent
            self.live.current.check_add(prepared, replace=replace)  # conflicts raise here
            version = self.store.write(name, data, replace=replace)
            mine = StoredAdapter(version, hashlib.sha256(data).hexdigest(), bundle, prepared)
            self._valid[name] = mine  # what we wrote is known: the sync below does not re-read it
            self._failed.pop(name, None)
            self._sync_locked()
            live = self.live.current
            current = self._valid.get(name, mine) if name in live else mine
        log.info("registered adapter %s (set v%d)", name, live.version)
        return current, live

    def delete(self, name: str) -> AdapterSet:
        with self.live.exclusive():
            self._sync_locked()
            if name not in self.invalid:  # an invalid object can always be deleted
                self.live.current.check_remove(name)  # unknown or still extended: raises here
            self.store.delete(name)
            self._sync_locked()
            live = self.live.current
        log.info("deleted adapter %s (set v%d)", name, live.version)
        return live

    def sync(self) -> bool:
        """Bring the live set in line with the store. Returns True if it changed."""
        with self.live.exclusive():
            return self._sync_locked()

    # -- the sync ---------------------------------------------------------------------------------
    def _sync_locked(self) -> bool:
        # The generation first: every change is written before it is counted, so the listing that
        # follows holds at least every change the generation counts.
        generation = self.store.generation()
        files = self.store.scan()
        if files == self._seen and generation == self._generation:
            return False
        if self._seen is not None and files != self._seen and generation == self._generation:
            # A change that was never counted: its writer is between its write and its bump, or
            # died there. Count it, so that no two replicas give one version to two states.
            generation = self.store.bump_generation()
        if generation < self._generation:
            log.warning("adapter store generation went back (%d -> %d): was the store reset?",
                        self._generation, generation)  # fmt: skip
        self._read_changed(files)
        ordered, invalid = _parents_first(self._valid, self.live.current.names)
        invalid.update({name: reason for name, (_, reason) in self._failed.items()})
        self._seen, self._generation, self.invalid = files, generation, invalid
        current = self.live.current
        prepared = tuple(e.prepared for e in ordered)
        if prepared == current.adapters:
            if current.version != generation:
                self.live.install(current.at_version(generation))
            return False
        live = self.live.install(AdapterSet(prepared, version=generation))
        added = sorted(set(live.names) - set(current.names))
        removed = sorted(set(current.names) - set(live.names))
        log.info("adapter store changed: +%s -%s (set v%d, %d live)", _short(added), _short(removed),
                 live.version, len(live))  # fmt: skip
        return True

    def _read_changed(self, files: dict[str, ObjectVersion]) -> None:
        """Read every bundle whose version differs from the one last read; forget removed ones."""
        for gone in (set(self._valid) | set(self._failed)) - set(files):
            self._valid.pop(gone, None)
            self._failed.pop(gone, None)
        changed = [
            name
            for name, version in files.items()
            if not (name in self._valid and self._valid[name].version == version)
            and not (name in self._failed and self._failed[name][0] == version)
        ]
        if not changed:
            return
        # Reading and parsing overlap in threads (object-store latency); the memory projections of
        # every bundle read are then batched (prepare_many: one matmul per layer, not per bundle).
        workers = min(self.read_workers, len(changed))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="store-read") as pool:
            results = list(pool.map(self._read, changed, [files[n] for n in changed]))
        parsed = []
        for name, result in zip(changed, results, strict=True):
            if isinstance(result, tuple):
                version, reason = result
                self._valid.pop(name, None)
                if self._failed.get(name, (None, None))[1] != reason:
                    self._log_refusal(name, reason)
                self._failed[name] = (version, reason)
            else:
                parsed.append(result)
        prepared = self.engine.prepare_many([p.bundle.weights for p in parsed])
        for p, adapter in zip(parsed, prepared, strict=True):
            self._valid[p.bundle.name] = StoredAdapter(p.version, p.sha256, p.bundle, adapter)
            self._failed.pop(p.bundle.name, None)
        if self._refusals > _REFUSALS_LOGGED:
            log.warning("adapter store: %d more objects not loaded (GET /adapters lists every reason)",
                        self._refusals - _REFUSALS_LOGGED)  # fmt: skip
        self._refusals = 0

    def _log_refusal(self, name: str, reason: str) -> None:
        # One line per refused object, up to a cap per sync: a store of 10,000 objects written for
        # another base must not bury the log.
        self._refusals += 1
        if self._refusals <= _REFUSALS_LOGGED:
            log.warning("adapter store: not loading %s: %s", name, reason)

    def _read(self, name: str, listed: ObjectVersion) -> _Parsed | tuple[ObjectVersion, str]:
        version = listed
        try:
            data, version = self.store.read(name, max_bytes=self.max_bundle_bytes)
            bundle = read_bundle(data, max_bytes=self.max_bundle_bytes)
            if bundle.name != name:
                raise UnknownAdapterError(f"{name} holds adapter {bundle.name!r}; object names must match")
            check_compatible(bundle, self.engine)
        except StoreUnavailableError:
            raise  # not the object's fault: no verdict on it; the sync fails and the next one retries
        except (MemvitError, OSError) as exc:
            return version, str(exc)
        return _Parsed(version, hashlib.sha256(data).hexdigest(), bundle)


@dataclass(frozen=True)
class _Parsed:
    version: ObjectVersion
    sha256: str
    bundle: AdapterBundle


def _parents_first(
    valid: dict[str, StoredAdapter], order: tuple[str, ...]
) -> tuple[list[StoredAdapter], dict[str, str]]:
    """Valid bundles with every parent before its extensions, and those whose parent is missing.

    Adapters already live keep their order; new ones follow by name.
    """
    rank = {name: i for i, name in enumerate(order)}
    pending = sorted(valid, key=lambda n: (rank.get(n, len(rank)), n))
    placed: list[StoredAdapter] = []
    names: set[str] = set()
    progress = True
    while pending and progress:
        progress = False
        remaining = []
        for name in pending:
            parent = valid[name].bundle.weights.parent
            if parent is None or parent in names:
                placed.append(valid[name])
                names.add(name)
                progress = True
            else:
                remaining.append(name)
        pending = remaining
    invalid = {
        name: f"extends {valid[name].bundle.weights.parent!r}, which is not a valid bundle in the store"
        for name in pending
    }
    return placed, invalid


def _short(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... {len(names) - limit} more' if len(names) > limit else ''}]"
