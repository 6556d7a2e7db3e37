"""The heap frozen once loaded and the collections after it timed (server/telemetry/gc_pauses.py)."""

from __future__ import annotations

import gc

from prometheus_client import generate_latest

from memvit.server.telemetry.gc_pauses import settle_heap, watch_collections
from memvit.server.telemetry.metrics import Metrics


def _count(metrics: Metrics, generation: str) -> float:
    return metrics.registry.get_sample_value("memvit_gc_seconds_count", {"generation": generation}) or 0.0


def test_full_and_middle_collections_are_timed_young_ones_not() -> None:
    metrics = Metrics()
    timed = watch_collections(metrics)
    try:
        gc.collect(0)
        assert _count(metrics, "1") == _count(metrics, "2") == 0  # generation 0: not observed
        gc.collect(1)
        gc.collect()
        assert _count(metrics, "1") >= 1 and _count(metrics, "2") >= 1
        total = metrics.registry.get_sample_value("memvit_gc_seconds_sum", {"generation": "2"})
        assert 0 < total < 60
    finally:
        gc.callbacks.remove(timed)


def test_settling_freezes_the_heap_and_says_how_much() -> None:
    metrics = Metrics()
    timed = settle_heap(metrics)
    try:
        frozen = metrics.registry.get_sample_value("memvit_gc_frozen_objects")
        # Frozen objects still die when their last reference goes (another test's thread may drop
        # some between the freeze and this line), so the count can only have fallen, and a little.
        now = gc.get_freeze_count()
        assert now > 1000 and now <= frozen <= now * 1.01
        assert b"memvit_gc_seconds_bucket" in generate_latest(metrics.registry)
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()
