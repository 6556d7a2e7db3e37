"""Where usage is written durably: beside the adapters, in the adapter store's folder or bucket.

Each replica writes one record per interval (server/tenancy/usage.py), never touching another replica's:

- a folder: one line appended to ``.usage/<day>/<replica>.jsonl`` (its own file: no two writers
  ever share one), written in one ``write`` and fsynced. A replica killed mid-write may leave a
  torn last line; readers skip it, and a writer that finds one ends it before appending;
- a bucket: one object per record, ``.usage/<day>/<replica>/<seq>.json``, created with
  create-if-absent (objects cannot be appended to), so a record retried after an error that hid a
  success is written once.

``<day>`` is the UTC date the interval ended. Keys starting with ``.`` are never adapter names, so the
registry never sees these. Reading dedups records by (replica, seq): a retried line counts once.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from memvit.adapters.files import fsync_dir

from ..store import AdapterStore, LocalStore

log = logging.getLogger(__name__)
PREFIX = ".usage"
_CACHED = 100_000  # parsed bucket records kept (they never change): a day of 60 s records is 1,440


class UsageLog(ABC):
    """Append a replica's records; read every replica's records of some days."""

    location: str

    @abstractmethod
    def append(self, record: dict) -> None:
        """Write ``record`` (with ``replica``, ``seq`` and ``day``) durably, or raise."""

    @abstractmethod
    def _records(self, day: str) -> Iterator[dict]:
        """Every record of ``day`` as written (duplicates possible)."""

    def read(self, days: Iterable[datetime.date]) -> Iterator[dict]:
        """Every replica's records of ``days``, each once."""
        seen: set[tuple[str, int]] = set()
        for day in days:
            for record in self._records(day.isoformat()):
                ident = (record.get("replica"), record.get("seq"))
                if ident not in seen:
                    seen.add(ident)
                    yield record


def encode(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _parse(line: bytes, where: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        log.warning("%s: skipping a torn or unreadable usage record (%d bytes)", where, len(line))
        return None
    return record if isinstance(record, dict) else None


class LocalUsageLog(UsageLog):
    def __init__(self, root: Path) -> None:
        self.root = Path(root) / PREFIX
        self.location = str(self.root)

    def append(self, record: dict) -> None:
        folder = self.root / record["day"]
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(folder.parent)
            fsync_dir(folder.parent.parent)
        path = folder / f"{record['replica']}.jsonl"
        data = encode(record)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: its last byte
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn line (this replica's, killed)
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if size == 0:
            fsync_dir(folder)  # the new file's name survives a crash too

    def _records(self, day: str) -> Iterator[dict]:
        folder = self.root / day
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("*.jsonl")):
            with open(path, "rb") as f:
                for line in f:
                    if line.strip() and (record := _parse(line, str(path))) is not None:
                        yield record


class ObjectUsageLog(UsageLog):
    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        self.location = f"{store.location}/{PREFIX}"
        self._cache: dict[str, dict | None] = {}

    def append(self, record: dict) -> None:
        from ..store.base import ObjectExistsError

        key = f"{PREFIX}/{record['day']}/{record['replica']}/{record['seq']:010d}.json"
        with contextlib.suppress(ObjectExistsError):  # an earlier try wrote it after all: once
            self.store._put(key, encode(record), mode="create")

    def _records(self, day: str) -> Iterator[dict]:
        keys = sorted(self.store._list(f"{PREFIX}/{day}/"))
        missing = [k for k in keys if k not in self._cache]
        with ThreadPoolExecutor(self.store.read_parallelism) as pool:
            for key, data in zip(missing, pool.map(lambda k: self.store._get(k)[0], missing), strict=True):
                if len(self._cache) >= _CACHED:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = _parse(data, key)
        for key in keys:
            if (record := self._cache.get(key)) is not None:
                yield record


def usage_log_for(store: AdapterStore) -> UsageLog:
    """The usage log beside ``store``'s adapters."""
    if isinstance(store, LocalStore):
        return LocalUsageLog(store.root)
    return ObjectUsageLog(store)
