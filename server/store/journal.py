"""The registry's change journal and its index, on any store backend (docs/design.md §4).

Keys (under the store's directory or prefix):

    bundles/<name>/<sha256[:24]>-<nonce>.safetensors  a bundle object: written once, never changed
    <name>.safetensors                                a bundle of a store written before the journal
    .journal/<generation:016d>.json                   change g (g = 1, 2, ...): created once, never rewritten
    .journal/base.json                                the registry the journal starts from (written once)
    .index.json                                       the registry after some change g: a cache of the above

The one atomic step of a change is claiming its slot: ``claim`` creates ``.journal/<g>.json`` with
create-if-absent, so of several writers exactly one gets slot g. A writer puts its bundle object
first and claims after, so a journaled key always exists; a writer killed in between leaves an
object nothing references (garbage), never a half-registered adapter. The registry's version is the
journal's head, so replicas that applied the same entries report the same number.

An idle poll is one GET of the next slot (a 404); a change costs one GET of its entry; start-up is
one GET of the index plus one per entry written since it. Every ``COMPACT_EVERY`` changes the writer
of the change rewrites the index (compare-and-swap on the version it read, so it never moves back).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time

from .base import AdapterStore, ObjectChangedError, ObjectExistsError, ObjectVersion, StoreUnavailableError
from .entries import Entry, JournalDamagedError, Snapshot, parse_entry

log = logging.getLogger(__name__)

INDEX_KEY = ".index.json"
BASE_KEY = ".journal/base.json"
BUNDLES = "bundles"
COMPACT_EVERY = 256
_CAS_ATTEMPTS = 20


def entry_key(generation: int) -> str:
    return f".journal/{generation:016d}.json"


def bundle_key(name: str, sha256: str) -> str:
    """A new object per registration. The content hash says what it holds; the nonce makes a key
    that was ever unreferenced impossible to reference again, so deleting it (after the journal
    stopped naming it) can never take the bytes of a later registration of the same content."""
    return f"{BUNDLES}/{name}/{sha256[:24]}-{secrets.token_hex(4)}.safetensors"


class Journal:
    """Reads and writes the journal, its base and the index of one store (no state of its own
    beyond the index version it last read or wrote)."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        self.index_version: ObjectVersion | None = None  # of the index read or written last
        self.index_generation = -1

    # -- the index and the base --------------------------------------------------------------------
    def read_index(self) -> Snapshot | None:
        """The index (None when the store has none). Raises ``JournalDamagedError`` naming it if
        it cannot be parsed (its version is kept, so a repair can replace exactly that object)."""
        try:
            raw, self.index_version = self.store._get(INDEX_KEY)
        except FileNotFoundError:
            return None
        snapshot = Snapshot.from_bytes(raw, f"{self.store.location}/{INDEX_KEY}")
        self.index_generation = snapshot.generation
        return snapshot

    def read_base(self) -> Snapshot | None:
        try:
            raw, _ = self.store._get(BASE_KEY)
        except FileNotFoundError:
            return None
        return Snapshot.from_bytes(raw, f"{self.store.location}/{BASE_KEY}")

    def create_base(self, snapshot: Snapshot) -> Snapshot:
        """Write the journal's base once (create-if-absent); returns the base that won."""
        try:
            self.store._put(BASE_KEY, snapshot.to_bytes(), mode="create")
            return snapshot
        except ObjectExistsError:
            won = self.read_base()
            assert won is not None, "a base that exists was read back"
            return won

    def save_index(self, snapshot: Snapshot) -> bool:
        """Replace the index with ``snapshot`` if it is ahead of it. Compare-and-swap on the version
        last read, re-read on a lost race: the index never moves back. True if this call wrote it."""
        data = snapshot.to_bytes()
        for _ in range(_CAS_ATTEMPTS):
            if snapshot.generation <= self.index_generation:
                return False
            mode: str | ObjectVersion = self.index_version or "create"
            try:
                self.index_version = self.store._put(INDEX_KEY, data, mode=mode)
                self.index_generation = snapshot.generation
                return True
            except (ObjectExistsError, ObjectChangedError):
                # Another replica wrote it: learn its version and generation (a damaged one is
                # replaced on the next turn, on the version just read).
                with contextlib.suppress(JournalDamagedError):
                    self.read_index()
        log.warning("%s: the index was not rewritten (contention); the next writer will", self.store.location)
        return False

    # -- entries ---------------------------------------------------------------------------------------
    def read_entry(self, generation: int) -> Entry | None:
        """Change ``generation``, or None while its slot is free."""
        key = entry_key(generation)
        try:
            raw, _ = self.store._get(key, 1 << 20)
        except FileNotFoundError:
            return None
        return parse_entry(raw, f"journal entry {self.store.location}/{key}")

    def claim(self, generation: int, entry: Entry) -> bool:
        """Write ``entry`` as change ``generation`` if that slot is free. False: another writer has it."""
        data = json.dumps(entry.to_json(), separators=(",", ":")).encode()
        try:
            self.store._put(entry_key(generation), data, mode="create")
        except ObjectExistsError:
            return False
        return True

    # -- bundle objects --------------------------------------------------------------------------------
    def put_bundle(self, name: str, data: bytes) -> tuple[str, str]:
        """Write a bundle object under a new key. Returns (key, sha256)."""
        sha256 = hashlib.sha256(data).hexdigest()
        key = bundle_key(name, sha256)
        self.store._put(key, data, mode="create")
        return key, sha256

    def get_bundle(self, entry: Entry, max_bytes: int | None = None) -> bytes:
        """The bytes ``entry`` registered; ``FileNotFoundError`` if the object is gone (replaced and
        collected after this replica read the entry), ``ValueError`` if they are not those bytes."""
        assert entry.key is not None
        data, _ = self.store._get(entry.key, max_bytes)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ValueError(f"{entry.key} does not hold the bytes registered (SHA-256 differs)")
        return data

    def collect(self, key: str | None) -> None:
        """Delete an object the journal no longer references. Best effort: a failure leaves garbage."""
        if key is None:
            return
        try:
            self.store._delete(key)
        except FileNotFoundError:
            pass
        except (StoreUnavailableError, OSError) as exc:
            log.warning("adapter store: could not delete unreferenced %s (left as garbage): %s", key, exc)


def new_entry(op: str, name: str, **fields: object) -> Entry:
    return Entry(op, name, time=round(time.time(), 3), **fields)  # type: ignore[arg-type]
