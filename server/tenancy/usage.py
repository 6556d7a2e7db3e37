"""Usage per key: requests and images answered, and adapter rows computed, per key and task.

Counted in memory as requests are answered (``UsageMeter.record``, on the event loop), and written
durably every ``MEMVIT_USAGE_INTERVAL_SECONDS`` as one record per replica and interval
(server/tenancy/usage_log.py: a line in the adapter store's folder, or an object in its bucket)::

    {"format": "memvit.usage/1", "replica": "web-1-4242-a1b2c3", "seq": 17, "day": "2026-11-25",
     "start": "2026-11-25T10:00:00Z", "end": "2026-11-25T10:01:00Z",
     "usage": {"acme": {"base": [12, 30], "acme-cats": [12, 30]}}}

``usage[key][task]`` is [requests, images]: for ``base``, every request the key got answered and its
images; for an adapter, the requests that asked for it and the rows it computed (one per image).
A replica killed without warning loses at most the interval it had not written; a stop writes it.
A record that could not be written (the store unreachable) is kept and tried again, under the same
``seq``, so readers count it once however often it was tried. Empty intervals write nothing.

``summarize`` reads the records back per day, key and task: ``GET /usage`` and ``memvit usage``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from memvit.memory_core import BASE_TASK

from .usage_log import UsageLog

log = logging.getLogger(__name__)
FORMAT = "memvit.usage/1"
MAX_DAYS = 366  # one read covers at most this many days


def replica_name(configured: str | None = None) -> str:
    """This process's name in the usage log: unique per process (host, pid and a random suffix), so
    a restarted replica never appends to the file its killed predecessor may have torn."""
    base = configured or socket.gethostname() or "replica"
    base = re.sub(r"[^A-Za-z0-9._-]", "-", base)[:48]
    return f"{base}-{os.getpid()}-{secrets.token_hex(3)}"


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


class UsageMeter:
    """This replica's counts since the last record, and the loop that writes them."""

    def __init__(
        self,
        usage_log: UsageLog | None,
        replica: str,
        interval: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log, self.replica, self.interval = usage_log, replica, interval
        self._clock = clock
        self._lock = threading.Lock()  # the counts and the records: the loop and a writer thread
        self._counts: dict[str, dict[str, list[int]]] = {}
        self._start = clock()
        self._seq = 0
        self._unwritten: list[dict] = []  # closed intervals not written yet (a failed write's too)
        self._writing = threading.Lock()

    def record(self, key: str, images: int, tasks: Iterable[str]) -> None:
        """One request of ``key`` answered: ``images`` images for each of ``tasks`` (base included)."""
        with self._lock:
            per_task = self._counts.setdefault(key, {})
            for task in tasks:
                tally = per_task.setdefault(task, [0, 0])
                tally[0] += 1
                tally[1] += images

    def record_batch(self, groups: Iterable[tuple[str, int, int, Iterable[str]]]) -> None:
        """``record`` for many requests (a batch's), under one lock, in groups of the same key and
        tasks: (key, requests, images, tasks)."""
        with self._lock:
            for key, n, images, tasks in groups:
                per_task = self._counts.setdefault(key, {})
                for task in tasks:
                    tally = per_task.setdefault(task, [0, 0])
                    tally[0] += n
                    tally[1] += images

    def close_interval(self) -> None:
        """End the interval now: what was counted becomes a record to write (none if nothing was)."""
        now = self._clock()
        with self._lock:
            counts, self._counts = self._counts, {}
            start, self._start = self._start, now
            if counts:
                self._seq += 1
                day = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date().isoformat()
                self._unwritten.append(
                    {"format": FORMAT, "replica": self.replica, "seq": self._seq, "day": day,
                     "start": _iso(start), "end": _iso(now), "usage": counts}
                )  # fmt: skip

    def write(self) -> int:
        """Write the records not yet written, oldest first; returns how many. Raises (keeping the rest
        for the next try) when the log cannot be written. Blocking: run it in a thread."""
        if self.log is None:
            return 0
        written = 0
        with self._writing:  # one writer at a time: the interval's and the stop's never interleave
            while True:
                with self._lock:
                    if not self._unwritten:
                        return written
                    record = self._unwritten[0]
                self.log.append(record)
                with self._lock:
                    self._unwritten.pop(0)
                written += 1

    def flush(self) -> int:
        """End the interval and write everything (a stop; tests)."""
        self.close_interval()
        return self.write()

    async def run_forever(self) -> None:
        """Every ``interval`` on the clock (not ``interval`` after the last write ended, which would
        drift later under load): close the interval on the event loop, write it in a thread."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            self.close_interval()
            try:
                await asyncio.to_thread(self.write)
            except Exception as exc:  # the store is unreachable: keep the records, try next interval
                log.warning("usage could not be written to %s (%s); trying again", self.log.location, exc)
            due = max(due, loop.time() - self.interval)  # after a long stall, no burst of catch-ups


@dataclass(frozen=True)
class UsageRow:
    day: str
    key: str
    task: str  # "base": every request of the key; an adapter: the requests that asked for it
    requests: int
    images: int  # for an adapter: the rows it computed


def summarize(
    usage_log: UsageLog, first: datetime.date, last: datetime.date, keys: Callable[[str], bool] | None = None
) -> list[UsageRow]:
    """Every replica's usage from ``first`` to ``last`` (UTC days, both included), per day, key and
    task, sorted; ``keys``: only the keys it accepts."""
    if last < first:
        raise ValueError(f"the range ends ({last}) before it starts ({first})")
    span = (last - first).days + 1
    if span > MAX_DAYS:
        raise ValueError(f"{span} days asked for; at most {MAX_DAYS} at once")
    days = [first + datetime.timedelta(days=i) for i in range(span)]
    totals: dict[tuple[str, str, str], list[int]] = {}
    for record in usage_log.read(days):
        if record.get("format") != FORMAT or not isinstance(record.get("usage"), dict):
            continue
        day = str(record.get("day"))
        try:
            counted = [
                (key, task, int(requests), int(images))
                for key, per_task in record["usage"].items()
                if keys is None or keys(key)
                for task, (requests, images) in per_task.items()
            ]
        except (AttributeError, TypeError, ValueError):  # not written by this code: skip it whole
            where, replica = usage_log.location, record.get("replica")
            log.warning("%s: skipping a malformed usage record (replica %r)", where, replica)
            continue
        for key, task, requests, images in counted:
            tally = totals.setdefault((day, key, task), [0, 0])
            tally[0] += requests
            tally[1] += images
    rows = [UsageRow(d, k, t, r, i) for (d, k, t), (r, i) in totals.items()]
    # Per day and key, base first, then the adapters by name.
    return sorted(rows, key=lambda row: (row.day, row.key, row.task != BASE_TASK, row.task))
