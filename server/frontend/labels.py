"""Class names across the link, named by a key of their content.

An answer holds each task's class names (for the top k's labels), and a task of ImageNet's has a
thousand: pickled with every answer, they would be most of the model process's work per request. So
an answer names each task's labels by an 8-byte key of their content (``label_key``), computed once
per label tuple in the model process (``LabelKeys``); an API process (``LabelCache``) knows the
base's from the start, an adapter's from its own replica of the catalog (whose entries carry the
labels of the bundle they name) when the keys agree, or else from an earlier answer, and asks the
model process once for any it still lacks (an adapter replaced since its replica last read the
journal).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from ..inference.answers import Labels

CAPACITY = 4096  # label tuples remembered on each side


def label_key(labels: Labels) -> bytes | None:
    if labels is None:
        return None
    return hashlib.blake2b("\x1f".join(labels).encode(), digest_size=8).digest()


class _Bounded(OrderedDict):
    def remember(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > CAPACITY:
            self.popitem(last=False)


class LabelKeys:
    """The model process's side: a label tuple's key, computed once per tuple (thread-safe)."""

    def __init__(self) -> None:
        self._by_id = _Bounded()  # id(labels) -> (labels, key): holding the tuple keeps its id its own
        self._by_key = _Bounded()  # key -> labels, for the API processes that ask
        self._by_ids = _Bounded()  # ids of an answer's label tuples -> (those tuples, their keys)
        self._lock = threading.Lock()

    def key(self, labels: Labels) -> bytes | None:
        if labels is None:
            return None
        with self._lock:
            known = self._by_id.get(id(labels))
            if known is not None and known[0] is labels:
                return known[1]
        key = label_key(labels)
        with self._lock:
            self._by_id.remember(id(labels), (labels, key))
            self._by_key.remember(key, labels)
        return key

    def keys(self, labels: tuple[Labels, ...]) -> tuple[bytes | None, ...]:
        """Each task's key for an answer's labels: one lookup for the whole tuple (the tasks' label
        tuples are the adapters' own objects, the same in every batch; the entry holds them, so
        their ids stay theirs while it lives)."""
        ids = tuple(map(id, labels))
        with self._lock:
            known = self._by_ids.get(ids)
        if known is not None:
            return known[1]
        keys = tuple(self.key(one) for one in labels)
        with self._lock:
            self._by_ids.remember(ids, (labels, keys))
        return keys

    def cached(self) -> _BatchKeys:
        """``key`` for one batch's answers: each label tuple looked up once, without the lock."""
        return _BatchKeys(self)

    def labels(self, keys: Sequence[bytes]) -> dict[bytes, tuple[str, ...]]:
        with self._lock:
            return {k: self._by_key[k] for k in keys if k in self._by_key}


class _BatchKeys:
    def __init__(self, keys: LabelKeys) -> None:
        self._keys = keys
        self._tuples: dict[int, tuple[bytes | None, ...]] = {}  # the batch's answers hold the tuples

    def keys(self, labels: tuple[Labels, ...]) -> tuple[bytes | None, ...]:
        """Each task's key, once per tuple of labels (the requests of a batch asking the same tasks
        share theirs: server/inference/answers.py)."""
        known = self._tuples.get(id(labels))
        if known is None:
            known = self._tuples[id(labels)] = self._keys.keys(labels)
        return known


class LabelCache:
    """An API process's side: labels by key, from the catalog replica or asked for once."""

    def __init__(
        self,
        base: Labels,
        catalog_labels: Callable[[str], Labels],
        ask: Callable[[list[bytes]], Awaitable[dict[bytes, tuple[str, ...]]]],
    ) -> None:
        """``catalog_labels(name)``: the labels the catalog replica has for ``name`` (or None);
        ``ask(keys)``: the model process's labels for those keys."""
        self._known = _Bounded()
        self.catalog_labels, self.ask = catalog_labels, ask
        base_key = label_key(base)
        if base_key is not None:
            self._known.remember(base_key, base)

    async def resolve(self, tasks: Sequence[str], keys: Sequence[bytes | None]) -> tuple[Labels, ...]:
        out: list[Labels] = []
        missing: list[bytes] = []
        for task, key in zip(tasks, keys, strict=True):
            labels = None if key is None else self._known.get(key)
            if key is not None and labels is None:
                labels = self.catalog_labels(task)
                if labels is not None and label_key(labels) == key:
                    self._known.remember(key, labels)
                else:
                    labels = None
                    missing.append(key)
            out.append(labels)
        if missing:
            for key, labels in (await self.ask(missing)).items():
                self._known.remember(key, tuple(labels))
            out = [None if k is None else self._known.get(k) for k in keys]
        return tuple(out)
