"""Counts what a registry reads from its store (shared by the registry tests and benchmarks.store_scale)."""

from __future__ import annotations

from server.store import AdapterStore


def counting_reads(store: AdapterStore) -> list[str]:
    """Records the name of every bundle ``store`` reads from now on, in order."""
    reads: list[str] = []
    read = store.read

    def counted(name: str, **kwargs):
        reads.append(name)
        return read(name, **kwargs)

    store.read = counted  # type: ignore[method-assign]
    return reads
