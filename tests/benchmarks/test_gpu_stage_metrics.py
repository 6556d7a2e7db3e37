"""The server step's stage figures from /metrics (benchmarks/gpu/stage_metrics.py): means, and the
bucket holding each stage's and the whole request's p99 over one load."""

from __future__ import annotations

import math
from types import SimpleNamespace

from prometheus_client import generate_latest

from benchmarks.gpu.stage_metrics import (
    full_collections,
    graph_captures,
    parse_metrics,
    stage_means,
    stage_p99_bounds,
)
from memvit.server.telemetry.metrics import Metrics


def _scrape(metrics: Metrics) -> dict[str, float]:
    return parse_metrics(generate_latest(metrics.registry).decode())


def test_the_p99_bucket_of_each_stage_and_of_the_request_over_one_load() -> None:
    metrics = Metrics()  # a registry of its own
    metrics.stage_seconds.labels("decode").observe(2.0)  # before the load: not counted
    before = _scrape(metrics)
    for _ in range(3):
        metrics.latency.labels("/healthz").observe(9.0)  # another route: not the request's
    for _ in range(99):
        metrics.stage_seconds.labels("decode").observe(0.004)
        metrics.stage_seconds.labels("queue").observe(0.003)
        metrics.latency.labels("/classify").observe(0.02)
    metrics.stage_seconds.labels("decode").observe(0.004)
    metrics.stage_seconds.labels("queue").observe(0.2)  # one in a hundred: still within 99%
    metrics.latency.labels("/classify").observe(0.2)
    metrics.latency.labels("/classify").observe(0.2)  # two in 101: past 99%
    after = _scrape(metrics)
    bounds = stage_p99_bounds(before, after)
    assert bounds == {"decode": 5.0, "queue": 5.0, "request": 250.0}
    assert math.isclose(stage_means(before, after)["queue ms"], 1e3 * (99 * 0.003 + 0.2) / 100)
    assert stage_p99_bounds(after, after) == {}  # nothing observed over the load


def test_the_full_collections_over_one_load_and_the_longest() -> None:
    metrics = Metrics()
    full = metrics.gc_seconds.labels("2")
    full.observe(0.3)  # before the load
    before = _scrape(metrics)
    for seconds in (0.002, 0.2, 0.003):
        full.observe(seconds)
    metrics.gc_seconds.labels("1").observe(0.9)  # not a full one
    after = _scrape(metrics)
    assert full_collections(before, after) == {"full GCs": 3, "longest full GC ms (bound)": 250.0}
    assert "gc2" not in stage_p99_bounds(before, after) and "gc1" not in stage_p99_bounds(before, after)
    assert full_collections(after, after) == {"full GCs": 0, "longest full GC ms (bound)": None}


def test_the_graphs_captured_over_one_load() -> None:
    """Read from an engine's counters when scraped (``Metrics.watch_graphs``): here a stand-in's."""
    metrics = Metrics()
    engine = SimpleNamespace(graph_captures=5, graph_captures_beside=0, eager_passes=0)
    metrics.watch_graphs(engine)  # 5 before ready
    before = _scrape(metrics)
    engine.graph_captures, engine.graph_captures_beside, engine.eager_passes = 6, 2, 3
    after = _scrape(metrics)
    assert graph_captures(before, after) == {
        "graphs captured in a batch's way": 1, "graphs captured beside serving": 2, "eager passes": 3,
    }  # fmt: skip
    assert after["graphs captured before ready"] == 5
