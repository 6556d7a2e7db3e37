"""The adapter store, the service's source of truth: a local directory or an object store."""

from __future__ import annotations

from pathlib import Path

from .base import (
    GENERATION_KEY,
    SEEDED_KEY,
    SUFFIX,
    AdapterStore,
    ObjectTooLargeError,
    ObjectVersion,
    StoreUnavailableError,
    key_of,
)
from .local import LocalStore
from .object_store import SCHEMES, ObjectStore

__all__ = [
    "GENERATION_KEY",
    "SEEDED_KEY",
    "SUFFIX",
    "AdapterStore",
    "LocalStore",
    "ObjectStore",
    "ObjectTooLargeError",
    "ObjectVersion",
    "StoreUnavailableError",
    "is_object_url",
    "key_of",
    "open_store",
]


def is_object_url(location: str | Path) -> bool:
    return str(location).startswith(SCHEMES)


def open_store(location: str | Path) -> AdapterStore:
    """``s3://bucket/prefix`` (or gs://, az://): an object store; anything else: a local directory."""
    if is_object_url(location):
        store = ObjectStore(str(location))
        store.check()
        return store
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"unsupported adapter store URL {text!r}: use a directory or one of {', '.join(SCHEMES)}"
        )
    return LocalStore(text.removeprefix("file://"))
