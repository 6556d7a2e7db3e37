"""``memvit_cuda_graph_captures{where}`` and ``memvit_eager_passes``: read from the engine when scraped,
the captures before ready apart from those beside serving and those in a batch's way."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.host_counts import StandInEvent, StandInGraphs
from memvit.memory_core import LiveAdapters
from memvit.memory_core.routing.staging import HostBuffers
from memvit.server.telemetry.metrics import Metrics
from tests.conftest import images, random_adapter, tiny_engine


def scraped(metrics: Metrics) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name in ("memvit_cuda_graph_captures", "memvit_eager_passes"):
                values[sample.labels.get("where", sample.name)] = sample.value
    return values


def test_the_graph_counters_as_scraped() -> None:
    engine = tiny_engine()
    engine.embed_ahead = False  # one graph a pass
    engine.use_graphs(StandInGraphs(buffers=HostBuffers(pinned=False, new_event=StandInEvent.factory())))
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"a{i}", engine) for i in range(2)])
    x = images(engine, batch=2)
    engine(x, live.current, tasks=[["a0"], ["a1"]])  # "warm-up": one graph before ready
    metrics = Metrics()
    metrics.watch_graphs(engine)
    before = engine.graph_captures
    assert scraped(metrics) == {
        "before ready": before, "beside serving": 0, "in a batch's way": 0, "memvit_eager_passes": 0,
    }  # fmt: skip
    jobs: list = []
    with engine.first_use_beside(jobs.append):
        engine(x, live.current, tasks=[["a0", "a1"], []])  # a new shape: eagerly, captured beside
    jobs.pop()()
    engine(x, live.current, tasks=[["a1", "a0"], ["a0"]])  # the same shape: replayed
    engine(images(engine, batch=3), live.current, tasks=[["a1", "a0"], [], ["a0"]])  # captured in its way
    assert scraped(metrics) == {
        "before ready": before, "beside serving": 1, "in a batch's way": 1, "memvit_eager_passes": 1,
    }  # fmt: skip
