"""The heap frozen once loaded, and the collections after it timed.

A full collection holds every thread of the process, the engine's too, for as long as it walks the
heap: the ~430,000 objects torch and the model leave are why the server freezes them once ready
(memory_core/runtime.py ``freeze_heap``). What is left is timed here, per generation, in
``memvit_gc_seconds``: a latency spike that matches a full collection says so. Young collections
(generation 0: hundreds a second under load, microseconds each) are not observed.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from memvit.memory_core.runtime import freeze_heap

from .metrics import Metrics


def settle_heap(metrics: Metrics) -> Callable[[str, dict[str, Any]], None]:
    """Once this process has loaded what it serves: its heap frozen (``memvit_gc_frozen_objects``),
    then every collection of generation 1 or 2 timed into ``memvit_gc_seconds``. Returns the
    callback (``gc.callbacks.remove`` undoes it)."""
    metrics.gc_frozen.set(freeze_heap())
    return watch_collections(metrics)


def watch_collections(metrics: Metrics) -> Callable[[str, dict[str, Any]], None]:
    children = {g: metrics.gc_seconds.labels(str(g)) for g in (1, 2)}
    started = [0.0]
    clock = time.perf_counter

    def timed(phase: str, info: dict[str, Any]) -> None:
        child = children.get(info["generation"])
        if child is None:
            return
        if phase == "start":
            started[0] = clock()
        else:
            child.observe(clock() - started[0])

    gc.callbacks.append(timed)
    return timed
