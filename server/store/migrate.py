"""A store written before the journal, read once into the journal's base (docs/design.md §4).

Such a store holds ``<name>.safetensors`` bundles at its root and a ``.generation`` counter. The
first replica that finds no index lists the store once, reads and validates every bundle exactly as
a registration would, and proposes the result as the journal's base: valid bundles become entries
(referenced where they lie, by key), anything else is listed under ``invalid`` with the reason
(never fatal). The base continues from the old counter, so versions never go back. Several replicas
may do this at once; the base is created with create-if-absent, so they all adopt the first one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from memvit.memory_core import MemvitError

from .base import AdapterStore, StoreUnavailableError
from .entries import Entry, Snapshot

log = logging.getLogger(__name__)
# (name, key, bytes) -> the entry a registration of those bytes would journal; raises MemvitError
# (or ValueError, OSError) naming what is wrong with them.
Validate = Callable[[str, str, bytes], Entry]
_LOGGED = 20


def legacy_snapshot(store: AdapterStore, validate: Validate, *, max_bytes: int) -> Snapshot:
    """The registry a store written before the journal holds (an empty one for a new store)."""
    generation = store.legacy_generation()
    bundles = store.legacy_bundles()  # the one LIST of the store's life
    if not bundles:
        return Snapshot(generation)

    def read(name: str) -> Entry | str:
        key = bundles[name]
        try:
            data, _ = store._get(key, max_bytes)
            return validate(name, key, data)
        except StoreUnavailableError:
            raise  # not the object's fault: migration fails, and the next start retries it
        except (MemvitError, ValueError, OSError) as exc:
            return str(exc) or type(exc).__name__

    names = sorted(bundles)
    with ThreadPoolExecutor(min(store.read_parallelism, len(names)), thread_name_prefix="migrate") as pool:
        results = dict(zip(names, pool.map(read, names), strict=True))
    valid = {name: r for name, r in results.items() if isinstance(r, Entry)}
    invalid = {bundles[name]: r for name, r in results.items() if isinstance(r, str)}
    # An extension whose parent is not a valid bundle cannot be served: it is listed, not registered.
    while orphans := [n for n, e in valid.items() if e.parent is not None and e.parent not in valid]:
        for name in orphans:
            invalid[bundles[name]] = (
                f"extends {valid.pop(name).parent!r}, which is not a valid bundle in the store"
            )
    for key, reason in sorted(invalid.items())[:_LOGGED]:
        log.warning("adapter store: not registering %s: %s", key, reason)
    if len(invalid) > _LOGGED:
        log.warning("adapter store: %d more objects not registered (GET /adapters lists every reason)",
                    len(invalid) - _LOGGED)  # fmt: skip
    log.info("adapter store %s: %d bundles written before the journal registered, %d invalid, from v%d",
             store.location, len(valid), len(invalid), generation)  # fmt: skip
    return Snapshot(generation, valid, invalid)
