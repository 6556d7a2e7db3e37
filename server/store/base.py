"""The adapter store's one interface: bundles by name, a generation counter, seeding once.

A backend implements four primitives on keys (``_list``, ``_get``, ``_put``, ``_delete``), with
create-if-absent and replace-if-unchanged writes; everything the service relies on is built from
them here, once, so the local directory and an object store behave the same:

* ``write(name, data, replace=False)`` is create-if-absent: of two replicas creating one name, exactly
  one wins, the other gets ``DuplicateAdapterError``.
* ``generation()`` is a counter bumped (compare-and-swap) after every change. The service reports it
  as the adapter-set version, so it only grows, and two replicas serving one state report one number.
* ``seed_once`` gives a brand-new store its first bundles once in its life: the replica that creates
  the marker seeds, nobody ever again, so an acknowledged deletion is never undone.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from memory_core import DuplicateAdapterError, MemvitError, UnknownAdapterError, check_name

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
GENERATION_KEY = ".generation"  # keys starting with "." are never adapter names (NAME_PATTERN)
SEEDED_KEY = ".seeded"
_CAS_ATTEMPTS = 100


@dataclass(frozen=True)
class ObjectVersion:
    """What tells a changed object from an unchanged one without reading it."""

    tag: str  # an ETag, or a file's inode, size and mtime: changes whenever the bytes may have
    size: int


class StoreUnavailableError(MemvitError):
    """The store could not be reached or answered with an error (network, permissions, throttling).

    An expected condition for the HTTP layer: a 503 that says what failed, logged as one line.
    """

    expected = True


class ObjectTooLargeError(MemvitError):
    """An object in the store is larger than the bundle size limit; it was not read."""


class ObjectExistsError(Exception):
    """A create-if-absent write found the key taken (internal to the store)."""


class ObjectChangedError(Exception):
    """A replace-if-unchanged write found another version (internal to the store)."""


def key_of(name: str) -> str:
    check_name(name)  # raises for anything that is not a plain adapter name
    return f"{name}{SUFFIX}"


class AdapterStore(ABC):
    """Adapter bundles by name, in a local directory or an object store."""

    location: str  # for logs and messages
    # How many reads to run at once: a local disk is CPU-bound (parsing), an object store latency-bound.
    read_parallelism: int = 2

    # -- primitives (one implementation per backend) ---------------------------------------------
    @abstractmethod
    def _list(self) -> dict[str, ObjectVersion]:
        """Every key with its version (temp files excluded)."""

    @abstractmethod
    def _get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, ObjectVersion]:
        """The bytes of ``key`` and the version they are (FileNotFoundError when absent)."""

    @abstractmethod
    def _put(self, key: str, data: bytes, *, mode: str | ObjectVersion) -> ObjectVersion:
        """Write ``key`` durably and atomically. ``mode``: "create" (ObjectExistsError when taken),
        "overwrite", or the version to replace (ObjectChangedError when it is not the current one).
        Returns the version written."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove ``key`` (FileNotFoundError when absent)."""

    # -- bundles -----------------------------------------------------------------------------------
    def scan(self) -> dict[str, ObjectVersion]:
        """Bundles by adapter name (from the key), with their versions. Reads no bundle."""
        return {
            key[: -len(SUFFIX)]: version
            for key, version in self._list().items()
            if key.endswith(SUFFIX) and not key.startswith(".")
        }

    def read(self, name: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectVersion]:
        """The bytes of bundle ``name`` and their version (UnknownAdapterError when absent)."""
        try:
            return self._get(key_of(name), max_bytes)
        except FileNotFoundError:
            raise UnknownAdapterError(f"no adapter named {name!r} in the store", field="name") from None

    def write(self, name: str, data: bytes, *, replace: bool) -> ObjectVersion:
        """Persist a bundle. Without ``replace`` an existing name is a conflict (exactly one winner)."""
        try:
            version = self._put(key_of(name), data, mode="overwrite" if replace else "create")
        except ObjectExistsError:
            raise DuplicateAdapterError(
                f"an adapter named {name!r} is already in the store; ask to replace it", field="name"
            ) from None
        self.bump_generation()
        return version

    def delete(self, name: str) -> None:
        try:
            self._delete(key_of(name))
        except FileNotFoundError:
            raise UnknownAdapterError(f"no adapter named {name!r} in the store", field="name") from None
        self.bump_generation()

    # -- the generation ----------------------------------------------------------------------------
    def generation(self) -> int:
        """How many changes the store has seen (0 for a new store)."""
        return self._read_generation()[0]

    def bump_generation(self) -> int:
        """Count one more change (compare-and-swap, so concurrent bumps all count). Returns the new value."""
        for _ in range(_CAS_ATTEMPTS):
            current, version = self._read_generation()
            try:
                self._put(GENERATION_KEY, b"%d\n" % (current + 1), mode=version or "create")
                return current + 1
            except (ObjectExistsError, ObjectChangedError):
                continue  # another replica bumped in between: count on top of theirs
        raise StoreUnavailableError(f"{self.location}: could not update the generation (too much contention)")

    def _read_generation(self) -> tuple[int, ObjectVersion | None]:
        try:
            data, version = self._get(GENERATION_KEY, 64)
        except FileNotFoundError:
            return 0, None
        try:
            return int(data.strip()), version
        except ValueError:
            # A damaged counter must not stop the store, nor may it count backwards: go on from a
            # value no real count reaches.
            log.warning("%s: unreadable generation %r; counting on from 2**40", self.location, data[:20])
            return 1 << 40, version

    # -- seeding -----------------------------------------------------------------------------------
    def seed_once(self, bundles: Mapping[str, Path]) -> bool:
        """Give a brand-new store its first bundles, once in its life. Returns True if this call seeded.

        The replica that creates the marker (create-if-absent) seeds, and only if the store holds no
        bundle; nobody seeds after that, so an acknowledged deletion is never undone by a restart or
        by another replica starting on the same, now empty, store. A crash half-way leaves some seed
        bundles missing, never deleted ones back.
        """
        empty = not self.scan()
        note = b"seeded\n" if empty else b"had bundles before seeding was tracked\n"
        try:
            self._put(SEEDED_KEY, note, mode="create")
        except ObjectExistsError:
            return False
        if not empty:
            return False
        for name, source in bundles.items():
            try:
                self._put(key_of(name), source.read_bytes(), mode="create")
            except ObjectExistsError:
                continue
        self.bump_generation()
        return True

    def clean_temp_files(self, older_than: float = 3600.0) -> int:
        """Remove temp files left by writers that died (backends without temp files: nothing to do)."""
        return 0
