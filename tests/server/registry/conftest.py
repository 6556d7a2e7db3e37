"""Registries in one process, on both backends: replicas with their own live sets on one store."""

from __future__ import annotations

import pytest

from memvit.memory_core import LiveAdapters
from memvit.server.registry import AdapterRegistry
from memvit.server.store import open_store


@pytest.fixture
def replica(tiny_engine_for_bundles, store_location):
    """``replica(**kwargs)``: a registry opened on the test's store (kwargs: AdapterRegistry's)."""
    made: list[AdapterRegistry] = []

    def make(location: str | None = None, **kwargs) -> AdapterRegistry:
        kwargs.setdefault("max_bundle_bytes", 1 << 22)
        registry = AdapterRegistry(
            LiveAdapters(tiny_engine_for_bundles), open_store(location or store_location), **kwargs
        )
        registry.open()
        made.append(registry)
        return registry

    yield make
    for registry in made:
        registry.close()


@pytest.fixture
def bundles(make_bundle):
    """``bundles(names, **kwargs)``: (bundle, bytes) pairs for register_in_bulk."""

    def make(names, **kwargs):
        return [(b := make_bundle(name, **kwargs), b.to_bytes()) for name in names]

    return make
