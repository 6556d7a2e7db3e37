"""Prometheus metrics, one registry per app (so several apps in one process never collide).

Every label's values are bounded: routes by template, tasks by ``TaskLabels`` (base, a configured
list, the N most asked and ``other``: server/telemetry/task_labels.py), keys by the keys file's ids (plus
``admin`` and ``anonymous``), whatever the registry holds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .stages import STAGES, StageTimes, begin_stages
from .task_labels import TaskLabels

# Set in a request's scope by a route that counts itself (server/edge/guard.py says who sets it).
EDGE_DONE = "memvit.edge_done"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A stage on a GPU takes tens of microseconds (a copy, a graph replay): finer at the bottom.
MAX_TALLIES = 4096  # (key, tasks) tallies kept between reads of the metrics
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)


class Metrics:
    def __init__(self, task_labels: TaskLabels | None = None) -> None:
        self.task_labels = task_labels if task_labels is not None else TaskLabels()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "memvit_requests_total", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "memvit_request_seconds", "HTTP request latency", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "memvit_batch_images", "images per fused pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.fused_pass_seconds = Histogram(
            "memvit_fused_pass_seconds", "time of one fused pass", buckets=LATENCY_BUCKETS, registry=r
        )
        self.stage_seconds = Histogram(
            "memvit_stage_seconds",
            "where requests' time goes: receive, decode, queue, copy, pass, respond "
            "(server/telemetry/stages.py)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("memvit_queue_images", "images waiting for a fused pass", registry=r)
        self.rejected = Counter(
            "memvit_rejected_total", "requests refused because the queue was full", registry=r
        )
        self.adapters_loaded = Gauge(
            "memvit_adapters_loaded", "adapters in the live set (the resident ones)", registry=r
        )
        self.adapter_set_version = Gauge(
            "memvit_adapter_set_version", "version of the registry (the journal's head)", registry=r
        )
        self.adapters_registered = Gauge(
            "memvit_adapters_registered", "adapters in the registry, resident or not", registry=r
        )
        self.adapter_loads = Counter(
            "memvit_adapter_loads_total", "cold loads of adapters from the store", ["result"], registry=r
        )
        self.adapter_lookups = Counter(
            "memvit_adapter_lookups_total",
            "adapters asked for by requests: resident (hit) or not (miss)",
            ["result"],
            registry=r,
        )
        self.resident_adapters = Gauge("memvit_resident_adapters", "adapters resident in memory", registry=r)
        self.resident_bytes = Gauge("memvit_resident_bytes", "bytes of the resident adapters", registry=r)
        # Label values: base, the configured tasks, the N most asked, and "other" (task_labels.py).
        self.task_requests = Counter(
            "memvit_task_requests_total", "requests answered, per task asked", ["task"], registry=r
        )
        self.task_images = Counter(
            "memvit_task_images_total", "images answered, per task", ["task"], registry=r
        )
        # Label values: key ids of the keys file, "admin" and "anonymous" (bounded by the file).
        self.key_requests = Counter(
            "memvit_key_requests_total", "requests answered, per key", ["key"], registry=r
        )
        self.key_images = Counter("memvit_key_images_total", "images answered, per key", ["key"], registry=r)
        self.key_adapter_rows = Counter(
            "memvit_key_adapter_rows_total", "adapter rows computed (images x adapters), per key", ["key"],
            registry=r,
        )  # fmt: skip
        self.key_limited = Counter(
            "memvit_key_limited_total",
            "requests refused by a key's limit (images_per_second, requests_in_flight, images_per_request)",
            ["key", "limit"],
            registry=r,
        )
        # server/tenancy/audit.py: every attempt to change the adapter set, by action and the status answered.
        self.adapter_changes = Counter(
            "memvit_adapter_changes_total",
            "attempts to change the adapter set, by action (register, replace, delete) and HTTP status",
            ["action", "result"],
            registry=r,
        )
        self._key_metrics = (self.key_requests, self.key_images, self.key_adapter_rows)
        self._per_key: dict[str, tuple] = {}
        self._per_task: dict[str, tuple] = {}  # a task's label -> its two series
        self.ready = Gauge("memvit_ready", "1 once the model and the adapter store are loaded", registry=r)
        self.gc_seconds = Histogram(
            "memvit_gc_seconds",
            "garbage collections of generation 1 and 2 (full): each holds every thread of the process",
            ["generation"],
            buckets=(0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.gc_frozen = Gauge(
            "memvit_gc_frozen_objects", "objects frozen out of the collector's reach once loaded", registry=r
        )
        # server/inference/warmup.py: where the CUDA graphs were captured (read from the engine when
        # scraped: ``watch_graphs``), and the passes that ran eagerly while theirs was captured.
        self.graph_captures = Gauge(
            "memvit_cuda_graph_captures",
            "CUDA graphs captured: before ready, beside serving, or in a batch's way",
            ["where"],
            registry=r,
        )
        self.eager_passes = Gauge("memvit_eager_passes", "eager passes, graph captured beside", registry=r)
        self._tallies: dict[tuple[str, tuple[str, ...]], list[int]] = {}  # answered, not yet on the series
        self._tally_lock = threading.Lock()
        self._fold_lock = threading.Lock()

    def watch_graphs(self, engine) -> None:
        """Once ready: the engine's graph counters, read when scraped (``graph_captures``)."""
        at_ready, where = engine.graph_captures, self.graph_captures.labels
        where(where="before ready").set(at_ready)
        where(where="beside serving").set_function(lambda: engine.graph_captures_beside)
        where(where="in a batch's way").set_function(lambda: engine.graph_captures - at_ready)
        self.eager_passes.set_function(lambda: engine.eager_passes)

    def answered(self, key: str, images: int, tasks: Iterable[str], rows: int) -> None:
        """One request of ``key`` answered: ``images`` images for each of the ``tasks`` it asked for,
        ``rows`` adapter rows computed."""
        self.answered_batch([(key, 1, images, tuple(tasks), rows)])

    def answered_batch(self, groups: Iterable[tuple[str, int, int, tuple[str, ...], int]]) -> None:
        """Many requests answered (a batch's), in groups of the same key and tasks: (key, requests,
        images, tasks, adapter rows). Tallied by (key, tasks) only, one dict entry per group: the
        per-task and per-key series (~2 per task and 3 per key, each ``inc`` a lock and a few checks)
        are updated from the tallies when the metrics are read (``render``), in the order the groups
        came, so each series reads exactly what counting them at once would have. The engine's
        thread pays a dict update per group instead of ~20 series updates per batch."""
        with self._tally_lock:
            tallies = self._tallies
            for key, n, images, tasks, rows in groups:
                tally = tallies.get((key, tasks))
                if tally is None:
                    tallies[(key, tasks)] = [n, images, rows]
                else:
                    tally[0] += n
                    tally[1] += images
                    tally[2] += rows
            full = len(tallies) > MAX_TALLIES
        if full:  # many distinct asks and nobody reading: counted now, memory stays bounded
            with self._fold_lock:
                self._fold()

    def _fold(self) -> None:
        """The tallies since the last fold, counted on their series (under ``_fold_lock``: one fold
        at a time, so the tallies are counted in their order)."""
        with self._tally_lock:
            tallies, self._tallies = self._tallies, {}
        if not tallies:
            return
        per_task: dict[str, list[int]] = {}  # task -> [requests, images]
        per_key: dict[str, list[int]] = {}  # key -> [requests, images, adapter rows]
        for (key, tasks), (n, images, rows) in tallies.items():
            for task in tasks:
                tally = per_task.get(task)
                if tally is None:
                    tally = per_task[task] = [0, 0]
                tally[0] += n
                tally[1] += images
            tally = per_key.get(key)
            if tally is None:
                tally = per_key[key] = [0, 0, 0]
            tally[0] += n
            tally[1] += images
            tally[2] += rows
        self.task_labels.asked_counts({task: tally[0] for task, tally in per_task.items()})
        per_label: dict[str, list[int]] = {}
        for task, (n, images) in per_task.items():
            tally = per_label.setdefault(self.task_labels.label(task), [0, 0])
            tally[0] += n
            tally[1] += images
        for label, (n, images) in per_label.items():
            series = self._per_task.get(label)
            if series is None:  # a label lookup takes a lock: once per series, not per request
                series = (self.task_requests.labels(label), self.task_images.labels(label))
                self._per_task[label] = series
            series[0].inc(n)
            series[1].inc(images)
        for key, (n, images, rows) in per_key.items():
            counters = self._per_key.get(key)
            if counters is None:
                counters = self._per_key[key] = tuple(m.labels(key) for m in self._key_metrics)
            counters[0].inc(n)
            counters[1].inc(images)
            counters[2].inc(rows)

    def render(self) -> bytes:
        with self._fold_lock:
            self._fold()
            self.task_labels.refresh(self._drop_task)
        return generate_latest(self.registry)

    def _drop_task(self, task: str) -> None:
        self._per_task.pop(task, None)
        for counter in (self.task_requests, self.task_images):
            with contextlib.suppress(KeyError):  # never counted under its own label
                counter.remove(task)


class MetricsMiddleware:
    """Counts requests by route template (not raw path: bounded label values) and status, and times
    each request's stages (server/telemetry/stages.py): observed per stage and, with ``server_timing``, said
    in the response's ``Server-Timing`` header."""

    def __init__(self, app: ASGIApp, metrics: Metrics, server_timing: bool = False) -> None:
        self.app = app
        self.meter = RequestMeter(metrics, server_timing)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or EDGE_DONE in scope:  # counted by the route that set it
            await self.app(scope, receive, send)
            return
        metered = MeteredSend(send, self.meter, begin_stages())
        try:
            await self.app(scope, receive, metered)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.meter.observe(path, scope["method"], metered.status, metered.stages)


class MeteredSend:
    """``send`` for one metered request: remembers the status it answered with (500 until a response
    starts: the app failed) and adds the stages' ``Server-Timing`` header (``RequestMeter.starting``)."""

    __slots__ = ("meter", "send", "stages", "status")

    def __init__(self, send: Send, meter: RequestMeter, stages) -> None:
        self.send, self.meter, self.stages, self.status = send, meter, stages, 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = self.meter.starting(message, self.stages)
        await self.send(message)


class RequestMeter:
    """What the metrics middleware does for one request, for it and for a route served outside it
    (the raw ``/classify``): the Server-Timing header, the counters and the histograms."""

    def __init__(self, metrics: Metrics, server_timing: bool = False) -> None:
        self.metrics = metrics
        self.server_timing = server_timing
        # One child per stage, looked up once (``labels`` takes a lock and builds a key per call).
        self._stages = {stage: metrics.stage_seconds.labels(stage) for stage in STAGES}
        self._children: dict[tuple[str, str, int], tuple] = {}

    def starting(self, message: Message, stages: StageTimes) -> Message:
        """The response's start, as it leaves: the respond stage ends, Server-Timing if asked."""
        stages.responding()
        if self.server_timing and stages.seconds:
            header = (b"server-timing", stages.header().encode("latin-1"))
            return {**message, "headers": [*message.get("headers", []), header]}
        return message

    def observe(self, template: str, method: str, status: int, stages: StageTimes) -> None:
        children = self._children.get((template, method, status))
        if children is None:  # a label lookup takes a lock: once per route, method and status
            if len(self._children) > 4096:  # bounded as the labels are; a guard against surprises
                self._children.clear()
            m = self.metrics
            children = (m.requests.labels(template, method, str(status)), m.latency.labels(template))
            self._children[(template, method, status)] = children
        requests, latency = children
        requests.inc()
        latency.observe(time.perf_counter() - stages.started)
        for stage, seconds in stages.seconds.items():  # only requests that reached the pipeline
            self._stages[stage].observe(seconds)
