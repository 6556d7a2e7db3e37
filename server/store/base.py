"""The adapter store's one interface: four primitives on keys, and what every backend shares.

A backend implements ``_list``, ``_get``, ``_put`` and ``_delete``, with create-if-absent and
replace-if-unchanged writes. Everything the service relies on is built from them once, on top of
this class, so the local directory and an object store behave the same: the change journal and the
index (``journal.py``), the migration of a store written before the journal (``migrate.py``), and
seeding a brand-new store once in its life (``mark_seeded``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from memvit.memory_core import MemvitError, check_name

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
# Keys starting with "." are never adapter names (NAME_PATTERN), so hidden keys cannot collide with
# bundles written before the journal (``<name>.safetensors`` at the root).
GENERATION_KEY = ".generation"  # the change counter of a store written before the journal
SEEDED_KEY = ".seeded"
SCHEMES = ("s3://", "s3a://", "gs://", "az://", "azure://", "abfs://", "abfss://")  # object stores


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
    """Where a store written before the journal kept bundle ``name`` (at the root)."""
    check_name(name)  # raises for anything that is not a plain adapter name
    return f"{name}{SUFFIX}"


def legacy_name(key: str) -> str | None:
    """The adapter name of a root-level ``<name>.safetensors`` key; None for any other key."""
    if "/" in key or key.startswith(".") or not key.endswith(SUFFIX):
        return None
    return key[: -len(SUFFIX)]


class AdapterStore(ABC):
    """Objects by key, in a local directory or an object store."""

    location: str  # for logs and messages
    # How many reads to run at once: a local disk is CPU-bound (parsing), an object store latency-bound.
    read_parallelism: int = 2

    # -- primitives (one implementation per backend) ---------------------------------------------
    @abstractmethod
    def _list(self, prefix: str = "") -> dict[str, ObjectVersion]:
        """Every key (starting with ``prefix``) with its version (temp files excluded). Only migration,
        the usage log (a prefix of its own) and tests list."""

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

    # -- a store written before the journal --------------------------------------------------------
    def legacy_bundles(self) -> dict[str, str]:
        """Root-level bundles by adapter name -> key (one LIST; migration only)."""
        return {name: key for key in self._list() if (name := legacy_name(key)) is not None}

    def legacy_generation(self) -> int:
        """The change counter a store kept before the journal (0 when it never had one)."""
        try:
            data, _ = self._get(GENERATION_KEY, 64)
        except FileNotFoundError:
            return 0
        try:
            return int(data.strip())
        except ValueError:
            # A damaged counter must not stop the store, nor may versions go back: go on from a
            # value no real count reaches.
            log.warning("%s: unreadable generation %r; counting on from 2**40", self.location, data[:20])
            return 1 << 40

    # -- seeding -----------------------------------------------------------------------------------
    def mark_seeded(self, empty: bool) -> bool:
        """Claim the one seeding of this store's life. True only for the caller that creates the
        marker (create-if-absent) while the registry is ``empty``: that caller seeds, nobody ever
        again, so an acknowledged deletion is never undone by a restart or by another replica."""
        note = b"seeded\n" if empty else b"had adapters before seeding was tracked\n"
        try:
            self._put(SEEDED_KEY, note, mode="create")
        except ObjectExistsError:
            return False
        return empty

    def clean_temp_files(self, older_than: float = 3600.0) -> int:
        """Remove temp files left by writers that died (backends without temp files: nothing to do)."""
        return 0
