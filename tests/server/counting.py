"""Counts what a registry asks of its store (shared by the registry tests and the benchmarks)."""

from __future__ import annotations

from memvit.server.store import AdapterStore

PRIMITIVES = ("_list", "_get", "_put", "_delete")


def counting_requests(store: AdapterStore) -> list[tuple[str, str]]:
    """Records every request ``store`` makes from now on, in order: (primitive, key)."""
    requests: list[tuple[str, str]] = []
    for primitive in PRIMITIVES:
        original = getattr(store, primitive)

        def counted(*args, _original=original, _primitive=primitive, **kwargs):
            requests.append((_primitive, args[0] if args else ""))
            return _original(*args, **kwargs)

        setattr(store, primitive, counted)
    return requests


def bundle_reads(requests: list[tuple[str, str]]) -> list[str]:
    """The bundle objects among ``requests`` that were read (GETs of anything but the journal's own)."""
    return [key for op, key in requests if op == "_get" and key.endswith(".safetensors")]
