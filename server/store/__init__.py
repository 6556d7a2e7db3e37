"""The adapter store, the service's source of truth: a local directory or an object store.

``ObjectStore`` (and with it obstore) is imported only when a store URL asks for it: a server on a
local directory never loads the object-store client.

Imports nothing of memvit.server (the lowest layer but the named errors and settings): everything
above may read and write through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import (
    GENERATION_KEY,
    SCHEMES,
    SEEDED_KEY,
    SUFFIX,
    AdapterStore,
    ObjectTooLargeError,
    ObjectVersion,
    StoreUnavailableError,
    key_of,
)
from .entries import Entry, JournalDamagedError, Snapshot
from .local import LocalStore

if TYPE_CHECKING:
    from .object_store import ObjectStore

__all__ = [
    "GENERATION_KEY",
    "SCHEMES",
    "SEEDED_KEY",
    "SUFFIX",
    "AdapterStore",
    "Entry",
    "JournalDamagedError",
    "LocalStore",
    "ObjectStore",
    "ObjectTooLargeError",
    "ObjectVersion",
    "Snapshot",
    "StoreUnavailableError",
    "is_object_url",
    "key_of",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "ObjectStore":
        from .object_store import ObjectStore

        return ObjectStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_object_url(location: str | Path) -> bool:
    return str(location).startswith(SCHEMES)


def open_store(location: str | Path) -> AdapterStore:
    """``s3://bucket/prefix`` (or gs://, az://): an object store; anything else: a local directory."""
    if is_object_url(location):
        from .object_store import ObjectStore

        store = ObjectStore(str(location))
        store.check()
        return store
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"unsupported adapter store URL {text!r}: use a directory or one of {', '.join(SCHEMES)}"
        )
    return LocalStore(text.removeprefix("file://"))
