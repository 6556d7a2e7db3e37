"""A shape first met on a serving thread (memory_core/routing/graphs_beside.py ``first_use_beside``):
its pass runs eagerly, its capture is scheduled once, and once captured the shape replays; a
capture scheduled for pools that have grown since, or for tokens of an embedding graph that is
gone, is dropped. On stand-in graphs (benchmarks/host_counts.py), against the dense reference."""

from __future__ import annotations

import pytest

from benchmarks.host_counts import StandInEvent, StandInGraphs
from memvit.memory_core import LiveAdapters
from memvit.memory_core.oracle.reference import DenseMemoryViT
from memvit.memory_core.routing.staging import HostBuffers
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine


class Recording(StandInGraphs):
    """Stand-in graphs that say whether the graphs' lock was held at each warm-up."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.warmed_locked: list[bool] = []

    def _warm_up(self, *args) -> None:
        self.warmed_locked.append(self._lock.locked())


def graphed(embed_ahead: bool):
    engine = tiny_engine()
    engine.embed_ahead = embed_ahead
    graphs = Recording(buffers=HostBuffers(pinned=False, new_event=StandInEvent.factory()), replays=True)
    engine.use_graphs(graphs)
    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, m=1 + i % 2, classes=3 + i) for i in range(3)]
    live.replace_all(weights)
    return engine, graphs, live, weights


def check(engine, weights, out, x) -> None:
    _, reference = DenseMemoryViT(engine.base, weights)(x)
    for name, logits in out.adapters.items():
        assert max_diff(logits, reference[name][out.images[name]]) <= TOL, name


@pytest.mark.parametrize("embed_ahead", [False, True], ids=["one graph", "embedding ahead"])
def test_a_first_shape_runs_eagerly_then_replays_what_was_captured_beside(embed_ahead) -> None:
    engine, graphs, live, weights = graphed(embed_ahead)
    x, tasks = images(engine, batch=3), [["a0", "a2"], ["a1"], []]
    jobs: list = []
    captured = graphs.captures
    with engine.first_use_beside(jobs.append):
        for _ in range(2):  # twice before its capture ran: eagerly both times, scheduled once
            out = engine(x, live.current, tasks=tasks)
            check(engine, weights, out, x)
        assert graphs.eager_passes == 2 and len(jobs) == 1
        embed_captures = graphs.captures - captured  # the embedding's graph alone, as before
        assert embed_captures == (1 if embed_ahead else 0)
        warmed = len(graphs.warmed_locked)
        jobs.pop()()
        assert graphs.captures_beside == 1
        assert graphs.warmed_locked[warmed:] == [False]  # its warm-up passes beside serving's replays
        out = engine(x, live.current, tasks=tasks)  # replayed
        check(engine, weights, out, x)
    assert graphs.eager_passes == 2 and not jobs and graphs.captures == captured + embed_captures


def test_a_capture_scheduled_before_the_pools_grew_is_dropped() -> None:
    engine, graphs, live, _ = graphed(embed_ahead=False)
    x = images(engine, batch=2)
    jobs: list = []
    with engine.first_use_beside(jobs.append):
        engine(x, live.current, tasks=[["a0", "a1"], []])
    live.add(random_adapter("wide", engine, m=1, classes=100))  # the pools grow
    engine(x, live.current, tasks=[["a2"], ["a1"]])  # a pass of the new generation
    jobs.pop()()
    assert graphs.captures_beside == 0  # it would have read the old pools


def test_a_capture_from_an_embedding_graph_that_is_gone_is_dropped() -> None:
    engine, graphs, live, _ = graphed(embed_ahead=True)
    x = images(engine, batch=2)
    jobs: list = []
    with engine.first_use_beside(jobs.append):
        engine(x, live.current, tasks=[["a0", "a1"], []])
    graphs.clear()  # the embedding's graph with it: its static tokens are no one's now
    jobs.pop()()
    assert graphs.captures_beside == 0


def test_a_capture_that_failed_is_scheduled_again_by_the_next_pass() -> None:
    engine, graphs, live, weights = graphed(embed_ahead=False)
    x, tasks = images(engine, batch=2), [["a0", "a1"], []]
    jobs: list = []

    def failing(*args) -> None:
        raise RuntimeError("out of memory while warming up")

    graphs._warm_up = failing
    with engine.first_use_beside(jobs.append):
        engine(x, live.current, tasks=tasks)
        with pytest.raises(RuntimeError, match="warming up"):
            jobs.pop()()
        del graphs._warm_up  # the class's again
        check(engine, weights, engine(x, live.current, tasks=tasks), x)  # eagerly, scheduled again
        assert len(jobs) == 1 and graphs.eager_passes == 2
        jobs.pop()()
    assert graphs.captures_beside == 1
