"""Many adapters, fast, for the registry and routing benchmarks (registry_scale.py, ray_routing.py):
bundles made from one engine, a local store filled with them directly, and a Zipf trace of names."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

import numpy as np

from memvit.adapters import AdapterBundle, bundle_for
from memvit.memory_core import MemoryViT
from memvit.server.registry.bundles import entry_for
from memvit.server.store import LocalStore, Snapshot
from memvit.server.store.journal import BASE_KEY, INDEX_KEY, bundle_key
from tests.factories import random_adapter


def bundles(engine: MemoryViT, count: int, m: int, classes: int) -> Iterator[tuple[AdapterBundle, bytes]]:
    for i in range(count):
        bundle = bundle_for(random_adapter(f"a{i:06d}", engine, m=m, classes=classes), engine)
        yield bundle, bundle.to_bytes()


def fill_local(store: LocalStore, items: Iterator[tuple[AdapterBundle, bytes]]) -> int:
    """Bundle objects as plain files, then the journal's base and index (the store's own writes)."""
    entries = []
    for bundle, data in items:
        sha256 = hashlib.sha256(data).hexdigest()
        key = bundle_key(bundle.name, sha256)
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries.append(entry_for(bundle, key, sha256, len(data)))
    snapshot = Snapshot(len(entries), {e.name: e for e in entries})
    data = snapshot.to_bytes()
    store._put(BASE_KEY, data, mode="create")
    store._put(INDEX_KEY, data, mode="create")
    return len(entries)


def zipf_trace(universe: int, length: int, s: float, seed: int) -> tuple[list[str], list[int]]:
    """Adapter names by popularity rank (shuffled, so popularity is not alphabetical) and a trace of ranks."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, universe + 1, dtype=float) ** -s
    ranks = rng.choice(universe, size=length, p=p / p.sum()).tolist()
    names = [f"a{i:06d}" for i in range(universe)]
    random.Random(seed).shuffle(names)
    return names, ranks
