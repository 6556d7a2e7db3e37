"""What a registry answers from its catalog alone: for the in-process registry (registry.py) and an
API process's replica of it (server/frontend/remote.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memvit.memory_core import UnknownAdapterError

from ..store import Entry
from .catalog import Catalog


@dataclass(frozen=True)
class RegistryInfo:
    """What every answer says about the registry: its version (the journal's head: equal versions,
    equal registries, on every replica) and how many adapters it holds."""

    version: int
    adapters: int


class CatalogReads:
    """What a registry answers from its catalog alone, for the in-process registry and an API
    process's replica of it (server/frontend/remote.py). Needs ``catalog`` and ``_counts`` (recent
    versions -> adapters registered then)."""

    catalog: Catalog
    _counts: dict[int, int]

    @property
    def version(self) -> int:
        return self.catalog.version

    def __len__(self) -> int:
        return len(self.catalog)

    def info(self, version: int | None = None) -> RegistryInfo:
        """The registry at ``version`` (a snapshot's, say), as far as it is remembered; else now."""
        count = self._counts.get(version) if version is not None else None
        if count is None:
            return RegistryInfo(self.catalog.version, len(self.catalog))
        return RegistryInfo(version, count)  # type: ignore[arg-type]  # not None here

    def get(self, name: str) -> Entry:
        """The registered adapter ``name`` (UnknownAdapterError, a 404, when it is not registered)."""
        entry = self.catalog.get(name)
        if entry is None:
            raise UnknownAdapterError(f"no adapter named {name!r} is registered", field="name")
        return entry

    def unknown(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self.catalog]

    def all_names(self) -> list[str]:
        return list(self.every_name())

    def every_name(self) -> tuple[str, ...]:
        """Every registered name, built once per version (an unfiltered request asks for all)."""
        version, names = getattr(self, "_every", (None, ()))
        if version != self.catalog.version:
            names = tuple(e.name for e in self.catalog.page(None, len(self.catalog)))
            self._every = (self.catalog.version, names)
        return names
