"""What the registry asks of a bundle before journaling it, and what it records: a change checked
against the registry, the journal entry of a bundle, and what holding it resident costs."""

from __future__ import annotations

from typing import Any

import torch

from memvit.adapters import AdapterBundle
from memvit.memory_core import AdapterInUseError, DuplicateAdapterError, MissingParentError

from ..store import Entry, Snapshot
from ..store.entries import dependents
from ..store.journal import new_entry


def check_put(state: Snapshot, bundle: AdapterBundle, replace: bool) -> None:
    """Refuse a registration that conflicts with the registry (before anything is written, and again
    after every change that won a journal slot first)."""
    name, parent = bundle.name, bundle.weights.parent
    if parent is not None and parent not in state.adapters:
        raise MissingParentError(
            f"adapter {name!r} extends {parent!r}, which is not registered; register the parent first",
            field="parent",
        )
    if name not in state.adapters:
        return
    if not replace:
        raise DuplicateAdapterError(
            f"an adapter named {name!r} is already registered; remove it first or ask to replace it",
            field="name",
        )
    if users := sorted(dependents(state.adapters, name)):
        raise AdapterInUseError(
            f"cannot replace {name!r}: {users} extend it and were trained against the current version",
            field="name",
        )


def entry_for(bundle: AdapterBundle, key: str, sha256: str, size: int) -> Entry:
    """The journal entry registering ``bundle``, stored at ``key``: all a listing shows of it."""
    w = bundle.weights
    return new_entry(
        "put",
        bundle.name,
        key=key,
        size=size,
        sha256=sha256,
        parent=w.parent,
        memory_tokens=w.num_memory,
        memory_norm=w.memory_norm,
        labels=tuple(bundle.labels),
        base_model=bundle.base_model,
        base_fingerprint=bundle.base_fingerprint,
    )


def resident_bytes(bundle: AdapterBundle, prepared: Any) -> int:
    """Bytes a resident adapter holds: its prepared tensors and the weights kept beside them (a
    tensor the two share, as a float32 CPU engine's heads are, counted once)."""
    w = bundle.weights
    tensors = [w.memory, w.cls_token, w.head_weight, w.head_bias]
    tensors += [
        prepared.cls,
        prepared.memory_keys,
        prepared.memory_values,
        prepared.head_weight,
        prepared.head_bias,
    ]
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
