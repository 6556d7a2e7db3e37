"""Filling a store with registered adapters fast, for tests and benchmarks (benchmarks/registry_scale.py).

``register_in_bulk`` writes each bundle object and then the registry they make in one go: as journal
entries (one per adapter, as registrations would write them) or, for a fresh store, as the journal's
base and index directly (100,000 adapters in seconds, which one registration each would take hours to).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from memvit.adapters import AdapterBundle
from memvit.server.registry import Catalog
from memvit.server.registry.bundles import entry_for
from memvit.server.store import AdapterStore, Entry, Snapshot
from memvit.server.store.journal import BASE_KEY, INDEX_KEY, bundle_key


def entries_for(
    store: AdapterStore, bundles: Iterable[tuple[AdapterBundle, bytes]], *, workers: int = 8
) -> list[Entry]:
    """Write each bundle's object (in threads: an object store is latency-bound); their entries."""

    def put(item: tuple[AdapterBundle, bytes]) -> Entry:
        bundle, data = item
        sha256 = hashlib.sha256(data).hexdigest()
        key = bundle_key(bundle.name, sha256)
        store._put(key, data, mode="create")
        return entry_for(bundle, key, sha256, len(data))

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(put, bundles))


def register_in_bulk(
    store: AdapterStore, bundles: Iterable[tuple[AdapterBundle, bytes]], *, as_index: bool = False
) -> int:
    """Register ``bundles`` (bundle, its bytes) in ``store``; returns the registry's version after.

    ``as_index``: the store must be new; the adapters become its base (version = their number) and
    index at once, exactly what a migration of that many bundles would write. Otherwise each is
    journaled as a registration would journal it.
    """
    entries = entries_for(store, bundles)
    if as_index:
        snapshot = Snapshot(len(entries), {e.name: e for e in entries})
        data = snapshot.to_bytes()
        store._put(BASE_KEY, data, mode="create")
        store._put(INDEX_KEY, data, mode="create")
        return snapshot.generation
    catalog = Catalog(store)
    catalog.open(_no_legacy, max_bytes=1)
    for entry in entries:
        catalog.commit(lambda _state, e=entry: e)
    return catalog.version


def _no_legacy(name: str, key: str, data: bytes) -> Entry:
    raise ValueError("filling expects a store without bundles written before the journal")
