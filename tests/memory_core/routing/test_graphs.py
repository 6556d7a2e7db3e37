"""CUDA graphs of planned passes (memory_core/routing/graphs.py).

The bucketed plans a graph is captured for (padded batch, rows, lineage, outputs) are checked on CPU:
they answer exactly what the exact plan answers. Capture and replay need a GPU (``-m cuda``).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from memvit.memory_core import FusedOutput, LiveAdapters, plan_pass
from memvit.memory_core.routing.graphs import bucket_images, bucket_rows
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.fixture(autouse=True)
def float32_without_tf32():
    """Graph against eager in float32 as the server runs it (``exact_float32``): with cuDNN's TF32
    convolutions on, a replay padded to its bucket (3 images -> 4) may take another convolution
    algorithm than the eager pass and land 1.6e-4 away (an H200, ba5e65b): a difference of shapes,
    not of graphs, that these tests would then blame on the graph."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_buckets() -> None:
    assert [bucket_images(n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65, 250, 257)] == [
        1, 2, 4, 8, 8, 16, 24, 64, 96, 256, 320,
    ]  # fmt: skip
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def mixed(engine):
    adapters = [random_adapter(f"a{i}", engine, m=i % 4, classes=2 + i) for i in range(6)]
    adapters += [
        random_adapter("child", engine, m=1, parent="a2"),
        random_adapter("gc", engine, parent="child"),
    ]
    return adapters


@pytest.mark.parametrize("tasks", ["all", "one each", "mixed", "extensions"])
def test_a_bucketed_plan_answers_what_the_exact_plan_answers(tasks: str) -> None:
    engine = tiny_engine()
    loaded = engine.prepare_set(mixed(engine))
    batch = 5
    rng = random.Random(0)
    asked = {
        "all": None,
        "one each": [[rng.choice(loaded.names)] for _ in range(batch)],
        "mixed": [rng.sample(loaded.names, k) for k in (1, 0, 3, 2, 5)],
        "extensions": [["gc"], ["a1"], ["child", "a0"], [], ["gc", "a5"]],
    }[tasks]
    x = images(engine, batch=batch)
    exact = engine(x, loaded, tasks=asked)
    plan = plan_pass(
        loaded, engine.slots, asked, batch, images=bucket_images, rows=bucket_rows, pad_outputs=True
    )
    assert plan.shape.images == 8 and plan.shape.rows == bucket_rows(plan.shape.rows)
    padded = torch.cat([x, torch.randn(3, *x.shape[1:])])  # any images: their rows are never read
    base, adapters = engine.run_plan(padded, plan)
    out = FusedOutput.of_plan(base, adapters, plan, loaded)
    assert max_diff(out.base, exact.base) <= TOL
    assert out.adapters.keys() == exact.adapters.keys()
    for name, logits in exact.adapters.items():
        assert torch.equal(out.images[name], exact.images[name])
        assert max_diff(out.adapters[name], logits) <= TOL


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ahead", [False, True], ids=["one graph", "embedding ahead"])
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_graphs_replay_the_eager_pass_and_survive_adapter_changes(kernels: str, ahead: bool) -> None:
    engine = tiny_engine()
    engine.kernels, engine.embed_ahead = kernels, ahead
    live = LiveAdapters(engine)
    live.replace_all(mixed(engine))
    live.move_to("cuda")
    x = images(engine, batch=5).cuda()
    tasks = [["gc"], ["a1"], ["child", "a0"], [], ["gc", "a5"]]

    def both():
        engine.cuda_graphs = False
        eager = engine(x, live.current, tasks=tasks), engine(x, live.current)
        engine.cuda_graphs = True
        return eager, (engine(x, live.current, tasks=tasks), engine(x, live.current))

    eager, graphed = both()
    for e, g in zip(eager, graphed, strict=True):
        assert max_diff(g.base, e.base) <= 1e-4
        for name in e.adapters:
            assert max_diff(g.adapters[name], e.adapters[name]) <= 1e-4
    captures = engine._graphs().captures
    live.add(random_adapter("new", engine))  # a slot written in place: nothing recaptured
    live.remove("a3")
    engine(x, live.current, tasks=[["new"], ["a1"], ["child", "a0"], [], ["gc", "a5"]])
    assert engine._graphs().captures == captures
    live.add(random_adapter("long", engine, m=40))  # the pools grow: captured again, still right
    eager, graphed = both()
    assert engine._graphs().captures > captures
    for name in eager[1].adapters:
        assert max_diff(graphed[1].adapters[name], eager[1].adapters[name]) <= 1e-4


@pytest.mark.cuda
@cuda
def test_a_capture_survives_another_thread_allocating() -> None:
    """Captures run beside a thread that allocates pinned memory (a loader's pin-memory thread, a
    server's decode threads): in the default "global" capture mode its cudaHostAlloc would
    invalidate the capture and fail in that thread (routing/graphs.py ``CAPTURE_MODE``)."""
    engine = tiny_engine()
    live = LiveAdapters(engine)
    live.replace_all(mixed(engine))
    live.move_to("cuda")
    x = images(engine, batch=3).cuda()
    stop, errors = threading.Event(), []

    def churn() -> None:
        # Pinned memory allocated and freed to the driver each time (cudaHostAlloc, cudaFreeHost),
        # as a pin-memory thread does when its cache misses: unsafe calls during a global capture.
        try:
            while not stop.is_set():
                torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).fill_(1)
                torch._C._host_emptyCache()
        except Exception as exc:
            errors.append(exc)

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    try:
        for batch in (1, 2, 3):  # three bucketed shapes: three captures while the thread allocates
            for tasks in (None, [["a1"], ["child", "a0"], ["gc"]][:batch]):
                engine(x[:batch], live.current, tasks=tasks)
    finally:
        stop.set()
        worker.join()
    assert errors == []
    engine.cuda_graphs = False
    eager = engine(x, live.current, tasks=[["a1"], ["child", "a0"], ["gc"]])
    engine.cuda_graphs = True
    graphed = engine(x, live.current, tasks=[["a1"], ["child", "a0"], ["gc"]])
    for name in eager.adapters:
        assert max_diff(graphed.adapters[name], eager.adapters[name]) <= 1e-4
