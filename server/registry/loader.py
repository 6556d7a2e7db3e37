"""Reading registered bundles back: a cold load reads exactly the bytes the catalog names and
validates them exactly as a registration did (``read_bundle``, the name, ``check_compatible``,
``engine.prepare``). A bundle that fails here is remembered with its reason (listed under
``invalid``) and not read again until the registry changes that adapter."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any, NoReturn

from memvit.adapters import check_compatible, read_bundle
from memvit.memory_core import MemoryViT, MemvitError, UnknownAdapterError

from ..errors import UnknownTaskError
from ..store import Entry, ObjectTooLargeError, StoreUnavailableError
from .bundles import entry_for, resident_bytes
from .catalog import Catalog
from .resident import Resident

log = logging.getLogger(__name__)


class BundleLoader:
    def __init__(
        self, catalog: Catalog, engine: MemoryViT, *, max_bytes: int, catch_up: Callable[[], None]
    ) -> None:
        """``catch_up``: read the journal's latest changes (a bundle may have been collected after a
        change this replica has not read yet)."""
        self.catalog, self.engine, self.max_bytes, self.catch_up = catalog, engine, max_bytes, catch_up
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (sha256, why): registered, invalid here

    def load(self, name: str) -> Resident:
        """A cold load of ``name`` as the catalog names it now (UnknownTaskError: not servable)."""
        entry = self.catalog.get(name)
        for attempt in range(2):
            if entry is None:
                raise UnknownTaskError(
                    f"unknown task(s) [{name!r}]: deleted from the registry", field="tasks"
                )
            failed = self.failed.get(name)
            if failed is not None and failed[0] == entry.sha256:
                raise UnknownTaskError(f"adapter {name!r} cannot be served here: {failed[1]}", field="tasks")
            try:
                data = self.catalog.journal.get_bundle(entry, self.max_bytes)
                break
            except FileNotFoundError:
                if attempt:  # the registry names an object that is not there: refuse it, say why
                    self.refuse(entry, f"its bundle {entry.key} is missing from the store")
                self.catch_up()
                entry = self.catalog.get(name)
            except StoreUnavailableError as exc:
                raise StoreUnavailableError(f"adapter {name!r} could not be loaded: {exc}") from None
            except (ValueError, ObjectTooLargeError) as exc:
                self.refuse(entry, str(exc))
        try:
            bundle = read_bundle(data, max_bytes=self.max_bytes)
            if bundle.name != name:
                raise UnknownAdapterError(f"{entry.key} holds adapter {bundle.name!r}, not {name!r}")
            check_compatible(bundle, self.engine)
            prepared = self.engine.prepare(bundle.weights)
        except MemvitError as exc:
            self.refuse(entry, str(exc))
        return Resident(entry, bundle, prepared, resident_bytes(bundle, prepared))

    def refuse(self, entry: Entry, why: str) -> NoReturn:
        """Remember that ``entry``'s bundle cannot be served here, and raise the 422 that says why."""
        log.warning("adapter store: cannot serve %s: %s", entry.name, why)
        self.failed[entry.name] = (entry.sha256, why)
        raise UnknownTaskError(f"adapter {entry.name!r} cannot be served here: {why}", field="tasks")

    def training(self, entry: Entry) -> dict[str, Any] | None:
        """The ``training`` metadata of ``entry``'s bundle, read from the store (None if unreadable)."""
        try:
            data = self.catalog.journal.get_bundle(entry, self.max_bytes)
            return read_bundle(data, max_bytes=self.max_bytes).training
        except StoreUnavailableError:
            raise
        except (MemvitError, ValueError, FileNotFoundError):
            return None

    def validate_legacy(self, name: str, key: str, data: bytes) -> Entry:
        """A bundle of a store written before the journal, validated as a registration would be."""
        bundle = read_bundle(data, max_bytes=self.max_bytes)
        if bundle.name != name:
            raise UnknownAdapterError(f"{name} holds adapter {bundle.name!r}; object names must match")
        check_compatible(bundle, self.engine)
        return entry_for(bundle, key, hashlib.sha256(data).hexdigest(), len(data))
