"""Warm-up captures the graphs a server replays before it takes traffic: with the graph capture
replaced by a stand-in on the CPU (the eager pass, replayed in place: benchmarks/host_counts.py), a
load of one-task, base-only and every-task requests through the engine loop captures nothing more."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from benchmarks.host_counts import StandInEvent, StandInGraphs
from memvit.memory_core import LiveAdapters
from memvit.memory_core.routing.staging import HostBuffers
from memvit.server.inference.answers import Want
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop, Job
from memvit.server.inference.images import ImageDecoder
from memvit.server.inference.warmup import batch_buckets, shapes, warm_up
from memvit.server.telemetry.metrics import Metrics
from tests.conftest import TOL, max_diff, random_adapter
from tests.factories import tiny_engine
from tests.server.inference.test_device_decode import jpeg, photo
from tests.server.inference.test_engine_loop import SINK

MAX_BATCH = 16


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    graphs = StandInGraphs(buffers=HostBuffers(pinned=False, new_event=StandInEvent.factory()), replays=True)
    engine.use_graphs(graphs)
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"a{i}", engine, m=1 + i % 2, classes=5 + i) for i in range(4)])
    decoder = DeviceDecoder(ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000), "cpu")
    items = [decoder.prepare(jpeg(photo(i, (160 + 13 * i, 120 + 7 * (i % 5)))), f"p{i}") for i in range(12)]
    return engine, graphs, live, decoder, items


def serve(engine, graphs, live, decoder, items, asks, jobs: int = 150) -> tuple[int, int]:
    """(graphs captured at start-up, graphs captured while serving ``jobs`` random requests)."""
    loop = EngineLoop(
        live, DeviceRunner(engine, decoder), max_batch=MAX_BATCH, max_wait=0.002, max_queue=4096,
        metrics=Metrics(), warm=lambda adapters: warm_up(engine, adapters, MAX_BATCH, 64),
    )  # fmt: skip
    before = graphs.captures
    loop.start()
    started = graphs.captures
    rng, futures = random.Random(0), []
    try:
        for _ in range(jobs):
            adapters, future = rng.choice(asks), Future()
            tasks = None if adapters is None else ["base", *adapters]
            loop.submit(Job([rng.choice(items)], adapters, tasks, SINK, 1, False, context=future))
            futures.append(future)
        for future in futures:
            future.result(60)
    finally:
        loop.stop()
    return started - before, graphs.captures - started


CAPTURED_WHILE_SERVING = "a CUDA graph captured while serving"


def test_warm_up_captures_what_one_task_requests_meet(served, caplog) -> None:
    engine, graphs, live, decoder, items = served
    at_start, while_serving = serve(engine, graphs, live, decoder, items, [("a0",), ("a1",), ("a3",), ()])
    # Passes may share a graph; with the embedding ahead (engine.embed_ahead) each batch size's planned
    # passes also share one patch embedding's graph.
    embeddings = len(batch_buckets(MAX_BATCH)) if engine.embed_ahead else 0
    assert 0 < at_start <= len(shapes(live.current, MAX_BATCH, 64)) + embeddings
    assert while_serving == 0
    # Batches of one kind alone: only the base, every adapter, one adapter for the whole batch.
    # (and a routed batch as narrow as its one adapter: images asking for it or for nothing)
    for asks in ([()], [None], [("a2",)], [("a0",), ()]):
        assert serve(engine, graphs, live, decoder, items, asks, jobs=60)[1] == 0, asks
    assert CAPTURED_WHILE_SERVING not in caplog.text


def test_a_shape_warm_up_did_not_capture_runs_eagerly_and_is_captured_beside(served, caplog) -> None:
    """What warm-up does not promise (server/inference/warmup.py), here every adapter beside one:
    no batch waits for its capture; its passes run eagerly until the ``engine-graphs`` thread has
    captured it (once per shape: a few, not one per batch), then replay it."""
    engine, graphs, live, decoder, items = served
    caplog.set_level("WARNING", logger="memvit.server.inference.device_runner")
    eager, beside = graphs.eager_passes, graphs.captures_beside
    _, while_serving = serve(engine, graphs, live, decoder, items, [None, ("a0",)], jobs=200)
    assert while_serving == 0 and CAPTURED_WHILE_SERVING not in caplog.text
    assert graphs.eager_passes > eager
    assert 0 < graphs.captures_beside - beside <= 3 * len(batch_buckets(MAX_BATCH))


def grow_under_load(engine, device: str, *, clients: int = 3):
    """4 adapters live on ``engine``; one-task requests from ``clients`` threads while one install adds
    20 more (past the pools' 16 slots and classes), then the new adapters' requests for a while.
    Returns the answers counted during each capture of the grown pools' graphs, every (item,
    adapters, future) asked, the graphs captured while serving (not for pools grown ahead), every
    adapter's weights and the decoder."""
    live = LiveAdapters(engine)
    weights = [random_adapter(f"a{i}", engine, m=1 + i % 2, classes=5 + i) for i in range(4)]
    live.replace_all(weights)
    more = [random_adapter(f"n{i}", engine, m=2, classes=5 + i) for i in range(20)]
    decoder = DeviceDecoder(ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000), device)
    items = [decoder.prepare(jpeg(photo(i, (160 + 9 * i, 120))), f"p{i}") for i in range(6)]
    loop = EngineLoop(
        live, DeviceRunner(engine, decoder), max_batch=MAX_BATCH, max_wait=0.002, max_queue=4096,
        metrics=Metrics(), warm=lambda adapters: warm_up(engine, adapters, MAX_BATCH, 64),
    )  # fmt: skip
    loop.start()
    at_start = engine.graph_captures
    grow, answered, asked = live.on_growth, [], []

    def on_growth(adapter_set) -> None:  # answers given while the grown pools' graphs were captured
        before = sum(f.done() for _, _, f in asked)
        grow(adapter_set)
        answered.append(sum(f.done() for _, _, f in asked) - before)

    live.on_growth = on_growth
    stop = threading.Event()

    def load(asks) -> None:
        rng = random.Random(1)
        while not stop.is_set():
            item, adapters, future = rng.choice(items), rng.choice(asks), Future()
            loop.submit(Job([item], adapters, ["base", *adapters], SINK, 3, True, context=future))
            asked.append((item, adapters, future))
            future.result(60)

    old = [threading.Thread(target=load, args=([("a0",), ("a1",), ()],)) for _ in range(clients)]
    try:
        for client in old:
            client.start()
        prepared = [engine.prepare(w) for w in more]
        with live.exclusive() as current:
            for adapter in prepared:
                current = current.with_adapter(adapter)
            live.install(current)
        stop.set()
        for client in old:
            client.join(60)
        stop.clear()
        new = threading.Thread(target=load, args=([("n19",), ("a2",), ("n7",), ()],))
        new.start()
        time.sleep(0.5)
        stop.set()
        new.join(60)
    finally:
        loop.stop()
    return answered, asked, engine.graph_captures - at_start, weights + more, decoder


def check_alone(asked, reference: LiveAdapters, decoder, tol: float) -> None:
    """Every answer is its image's alone, by ``reference``'s engine."""
    runner = DeviceRunner(reference.engine, decoder)
    for item, adapters, future in asked:
        tasks = ["base", *adapters]
        answer = future.result(0)
        alone = runner.run([item], reference.current, [list(adapters)], [Want(0, 1, 3, True)])
        expected = alone.cut(Want(0, 1, 3, True), tasks, 1, 0)
        for t in range(len(tasks)):
            got, want = answer.task_logits(t), expected.task_logits(t)
            assert max_diff(torch.from_numpy(got), torch.from_numpy(want)) <= tol, (item.name, tasks[t])


def test_serving_goes_on_while_an_install_grows_the_pools(caplog) -> None:
    """An install past the pools' 16 slots and classes, under load: the grown pools' graphs are
    captured on the installing thread while the loop keeps answering from the old ones; nothing is
    captured on the serving path, before or after, and every answer is its image's alone, computed by
    an engine without graphs. (One task per image: what warm-up promises, server/inference/warmup.py.)
    On a GPU: tests/server/test_cuda_engine.py."""
    engine = tiny_engine()
    graphs = StandInGraphs(buffers=HostBuffers(pinned=False, new_event=StandInEvent.factory()), replays=True)
    engine.use_graphs(graphs)
    answered, asked, while_serving, weights, decoder = grow_under_load(engine, "cpu")
    assert answered and answered[0] > 0  # served while the graphs were captured
    assert while_serving == 0 and graphs.captures_beside > 0
    assert CAPTURED_WHILE_SERVING not in caplog.text
    reference = LiveAdapters(tiny_engine())  # the same base weights, no graphs: eager passes
    reference.replace_all(weights)
    check_alone(asked, reference, decoder, TOL)
