"""The adapter registry: the catalog of every registered adapter, and the resident set that serves a
bounded, recently used few of them (docs/design.md §4 and §5).

May import ``errors``, ``settings``, ``telemetry`` and ``store``; never tenancy, the inference loop
or HTTP.
"""

from __future__ import annotations

from .catalog import Catalog, Change
from .registry import AdapterRegistry, RegistryInfo
from .resident import Pin, Resident, ResidentSet

__all__ = ["AdapterRegistry", "Catalog", "Change", "Pin", "RegistryInfo", "Resident", "ResidentSet"]
