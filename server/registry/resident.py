"""The resident set: the registered adapters prepared in memory now, bounded, loaded on demand.

The live set (``LiveAdapters``, what passes read) holds the resident adapters and nothing else. It is
bounded by a count and optionally by bytes; past either, installing an adapter evicts others that no
request holds, in segmented-LRU order (eviction.py).

A request *pins* its adapters from the moment it asks for them until its batch has run, so a cold
load for another request never evicts what a queued one needs; if nothing can be evicted the load is
refused (503, Retry-After) rather than over-filling.

A cold load is *single flight*: however many requests ask at once for an adapter that is not
resident, one of them starts its load (read, verify, validate, prepare, in a worker thread) and
the others wait for that one. Nothing is evicted before the load has succeeded, so a load that fails
(the store unreachable, a bundle that does not validate) leaves the resident set as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from memvit.memory_core import LiveAdapters

from ..errors import ResidentSetFullError, TooManyTasksError, UnknownTaskError
from ..store import Entry, StoreUnavailableError
from ..telemetry.metrics import Metrics
from .eviction import SegmentedLRU
from .flight import Load, Pin, when_loaded
from .install import Installing, Resident

log = logging.getLogger(__name__)
_STALE_RETRIES = 3


class ResidentSet(Installing):
    """The resident adapters: pinned by requests, loaded on demand (single flight), counted. What is
    resident changes through ``Installing`` (install.py)."""

    def __init__(
        self,
        live: LiveAdapters,
        *,
        load: Callable[[str], Resident],
        current: Callable[[str], Entry | None],
        version: Callable[[], int],
        max_adapters: int,
        max_bytes: int | None = None,
        workers: int = 2,
        metrics: Metrics | None = None,
    ) -> None:
        """``load(name)``: read and prepare the adapter the catalog names (raises if it cannot);
        ``current(name)``: the catalog's entry now; ``version()``: the catalog's version."""
        self.live = live
        self._load, self._current, self._version = load, current, version
        self.max_adapters, self.max_bytes = max_adapters, max_bytes
        self.metrics = metrics
        self.loads = 0  # cold loads started (each reads one bundle): what single flight keeps low
        # Adapters asked for, resident ("hit") or not ("miss": loaded, or joining a load under way).
        self.lookups: Counter[str] = Counter(hit=0, miss=0)
        self._series: dict[str, object] = {}
        self._resident: dict[str, Resident] = {}
        self._order = SegmentedLRU(max_adapters)  # which to evict first
        self._pins: Counter[str] = Counter()
        # Requests asking the same adapters while all are resident (a burst of one key's, or every
        # unfiltered request) pin them as a group: the first pins each name (and touches the eviction
        # order once), the others count on it, O(1) each. ``_changes`` counts what could make a
        # group's adapters no longer resident as they were; a group pinned before a change takes no one.
        self._groups: dict[tuple[str, ...], list[int]] = {}  # names -> [requests holding it, _changes then]
        self._changes = 0
        self._stale: set[str] = set()  # replaced in the registry while pinned: reloaded when next asked
        self._loading: dict[str, Load] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # the bookkeeping above; never held while taking the live set's
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-load")

    # -- reading -----------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def get(self, name: str) -> Resident | None:
        return self._resident.get(name)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def pinned(self, name: str) -> bool:
        return self._pins[name] > 0

    # -- asking for adapters -----------------------------------------------------------------------
    def acquire(self, names: Iterable[str], *, optional: bool = False) -> Pin:
        """Pin ``names`` (parents before their extensions) and make them resident; blocks while
        loading. Raises what a load raised; then nothing is pinned and nothing was evicted.
        ``optional`` (a request for every adapter): one deleted meanwhile, or whose bundle does not
        validate here (listed under ``invalid``), is left out instead."""
        pin, loads = self._begin(tuple(names))
        try:
            for name, load in loads:
                load.future.exception()  # waits for it
                _settle(pin, name, load, optional)
        except BaseException:
            pin.release()
            raise
        return pin

    async def acquire_async(self, names: Iterable[str], *, optional: bool = False) -> Pin:
        """``acquire`` for the event loop: no thread is held while waiting for a load."""
        pin, loads = self._begin(tuple(names))
        try:
            for name, load in loads:
                with contextlib.suppress(Exception):  # _settle raises it, once the load is done
                    await asyncio.wrap_future(load.future)
                _settle(pin, name, load, optional)
        except BaseException:
            pin.release()
            raise
        return pin

    def acquire_then(
        self, names: Iterable[str], *, optional: bool = False, then: Callable[[Pin | BaseException], None]
    ) -> None:
        """``acquire`` without waiting, for a caller that is neither an event loop nor a thread that may
        block (the model process's link reader): ``then(pin)`` once every load is done, at once when
        every adapter is resident, else on the thread that finished the last load; ``then(error)``
        when one failed (nothing pinned then). Raises at once what ``acquire`` raises before loading."""
        pin, loads = self._begin(tuple(names))
        when_loaded(pin, loads, lambda name, load: _settle(pin, name, load, optional), then)

    def _begin(self, names: tuple[str, ...]) -> tuple[Pin, list[tuple[str, Load]]]:
        if len(names) > self.max_adapters:
            raise TooManyTasksError(
                f"this request needs {len(names)} adapters resident at once (ancestors included); "
                f"this server holds at most {self.max_adapters} (MEMVIT_RESIDENT_ADAPTERS)",
                field="tasks",
            )
        loads, started = [], []
        pins = self._pins
        with self._lock:
            group = self._groups.get(names)
            if group is not None and group[1] == self._changes:  # held, and nothing changed since
                group[0] += 1
                self._lookup("hit", len(names))
                return Pin(self._unpin_group, names), []
            for name in names:
                pins[name] = pins.get(name, 0) + 1
                if name in self._resident and name not in self._stale:
                    self._order.touch(name)
                    continue
                load = self._loading.get(name)
                if load is None:
                    load = self._loading[name] = Load()
                    started.append((name, load))
                loads.append((name, load))
            self._lookup("hit", len(names) - len(loads))  # once per request, not per adapter
            self._lookup("miss", len(loads))
            if not loads and group is None:  # the first of a group: requests asking the same follow
                self._groups[names] = [1, self._changes]
                return Pin(self._unpin_group, names), []
        for name, load in started:
            self._pool.submit(self._run, name, load)
        return Pin(self._unpin, names), loads

    def _unpin_group(self, names: tuple[str, ...]) -> None:
        with self._lock:
            group = self._groups[names]
            group[0] -= 1
            if group[0]:
                return
            del self._groups[names]
        self._unpin(names)

    def _unpin(self, names: tuple[str, ...]) -> None:
        with self._lock:
            for name in names:
                left = self._pins[name] - 1
                if left <= 0:
                    del self._pins[name]
                else:
                    self._pins[name] = left

    # -- loading -----------------------------------------------------------------------------------
    def _run(self, name: str, load: Load) -> None:
        if load.claim():  # else an extension that needed it first runs it inline
            self._execute(name, load)

    def _execute(self, name: str, load: Load) -> None:
        try:
            for _ in range(_STALE_RETRIES):
                entry = self._current(name)
                if entry is not None and entry.parent is not None:
                    self._ensure(entry.parent)  # installed before its extension
                with self._lock:
                    self.loads += 1
                if self.install(self._load(name), required=True):
                    break
            else:
                raise ResidentSetFullError(f"adapter {name!r} kept changing in the registry while loading")
            load.future.set_result(None)
            self._count("loaded")
        except BaseException as exc:
            load.future.set_exception(exc)
            self._count(_result_of(exc))
        finally:
            with self._lock:
                if self._loading.get(name) is load:
                    del self._loading[name]

    def _ensure(self, name: str) -> None:
        """Make ``name`` resident from inside a load (an extension's parent): joins its load in
        flight, or runs it here if no worker has started it (no worker ever waits on a queued job)."""
        with self._lock:
            if name in self._resident and name not in self._stale:
                return
            load = self._loading.get(name)
            if load is None:
                load = self._loading[name] = Load()
        if load.claim():
            self._execute(name, load)
        load.future.result()

    def _lookup(self, result: str, n: int = 1) -> None:
        if n:
            self.lookups[result] += n
            if self.metrics is not None:
                series = self._series.get(result)
                if series is None:  # a label lookup takes a lock: once per result
                    series = self._series[result] = self.metrics.adapter_lookups.labels(result)
                series.inc(n)

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.adapter_loads.labels(result).inc()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.resident_adapters.set(len(self._resident))
            self.metrics.resident_bytes.set(self._bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(pin: Pin, name: str, load: Load, optional: bool) -> None:
    """After ``load`` is done: raise what it raised, or leave out an adapter that cannot be served."""
    error = load.future.exception()
    if error is None:
        return
    if optional and isinstance(error, UnknownTaskError):
        pin.drop(name)
        return
    raise error


def _result_of(exc: BaseException) -> str:
    """The ``result`` label of a failed load, for memvit_adapter_loads_total."""
    if isinstance(exc, StoreUnavailableError):
        return "unavailable"
    if isinstance(exc, ResidentSetFullError):
        return "full"
    if isinstance(exc, UnknownTaskError):
        return "invalid"
    return "failed"
