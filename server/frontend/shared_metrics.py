"""``/metrics`` as one view of every process of a front end, whichever process is scraped.

Each process keeps its own ``Metrics`` (server/telemetry/metrics.py) and publishes its exposition text to a
directory the supervisor owns (a temp dir, removed at exit), every ``PUBLISH_SECONDS`` and at exit;
a scrape renders the scraped process's own metrics fresh and merges them with the others' last
published text. Merged: counters and histograms are summed (requests, images, passes); gauges by
what they mean (``GAUGES``): ready is the least of the processes' (0 while any is not), versions
and registry sizes the largest, queue depth and resident adapters the sum (in the model-process
front end only the model process sets them; the API processes' stay 0). So the view is at most
``PUBLISH_SECONDS`` behind for the processes not scraped, and never counts one twice.

Why not prometheus_client's multiprocess mode: its gauges cannot be removed or relabelled (the
bounded per-task series drop tasks, server/telemetry/task_labels.py) and it would change how every metric is
created; this leaves server/telemetry/metrics.py as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..telemetry.metrics import Metrics
from ..telemetry.task_labels import TaskLabels

log = logging.getLogger(__name__)
PUBLISH_SECONDS = 1.0
GAUGES = {  # how a gauge of several processes is one number; any other gauge is summed
    "memvit_ready": min,
    "memvit_adapter_set_version": max,
    "memvit_adapters_registered": max,
}


class SharedMetrics(Metrics):
    """This process's metrics (``name`` among the front end's), rendered merged with the others'."""

    def __init__(self, directory: Path, name: str, task_labels: TaskLabels | None = None) -> None:
        super().__init__(task_labels)
        self.directory = Path(directory)
        self.name = name

    def own(self) -> bytes:
        return super().render()

    def render(self) -> bytes:
        texts = [self.own().decode()]
        for path in sorted(self.directory.glob("*.prom")):
            if path.stem != self.name:
                with contextlib.suppress(OSError):
                    texts.append(path.read_text())
        return merge(texts)

    def publish(self) -> None:
        """This process's metrics where the others read them (written whole, then renamed)."""
        temp = self.directory / f".{self.name}.tmp"
        temp.write_bytes(self.own())
        os.replace(temp, self.directory / f"{self.name}.prom")

    async def publish_forever(self) -> None:
        try:
            while True:
                try:
                    self.publish()
                except OSError as exc:  # the directory went with the supervisor: nobody reads it
                    log.debug("metrics not published: %s", exc)
                await asyncio.sleep(PUBLISH_SECONDS)
        finally:
            with contextlib.suppress(OSError):
                self.publish()  # a stop publishes what it counted last


def merge(texts: Iterable[str]) -> bytes:
    """Several processes' exposition texts as one (see the module's doc)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            known = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if known.type != family.type:
                continue
            samples = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples.setdefault(key, []).append(sample.value)
    for name, family in families.items():
        for (sample, labels), numbers in values.get(name, {}).items():
            family.add_sample(sample, dict(labels), _combine(family, sample, numbers))
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _combine(family: Metric, sample: str, numbers: list[float]) -> float:
    if sample.endswith("_created"):
        return min(numbers)  # when the first process started counting
    if family.type == "gauge":
        return GAUGES.get(family.name, sum)(numbers)
    return sum(numbers)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
