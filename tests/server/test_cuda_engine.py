"""The engine loop on a GPU (``pytest -m cuda``): three batches in flight, JPEGs decoded on the device
stream, passes replayed from graphs captured at start-up, and every answer under load the answer its
image gets alone."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest
import torch

from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.memory_core.runtime import exact_float32
from memvit.server.inference.answers import Want
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop, Job
from memvit.server.inference.images import ImageDecoder
from memvit.server.inference.warmup import warm_up
from memvit.server.telemetry.metrics import Metrics
from tests.conftest import random_adapter
from tests.server.inference.test_device_decode import jpeg, photo
from tests.server.inference.test_engine_loop import SINK
from tests.server.inference.test_warmup import check_alone, grow_under_load

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]
MAX_BATCH = 16


@pytest.fixture(scope="module")
def served(tiny_weights):
    engine = MemoryViT.from_timm(weights=tiny_weights, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    exact_float32(engine.device, engine.dtype)  # as the server does: TF32 would make answers batch-dependent
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"a{i}", engine, m=1 + i % 2, classes=5 + i) for i in range(4)])
    cpu = ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000)
    decoder = DeviceDecoder(cpu, "cuda")
    uploads = [jpeg(photo(i, (160 + 13 * i, 120 + 7 * (i % 5)))) for i in range(24)]
    items = [decoder.prepare(data, f"p{i}") for i, data in enumerate(uploads)]
    yield engine, live, decoder, items
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def alone(engine, live, decoder, item, adapters) -> object:
    tasks = None if adapters is None else [list(adapters)]
    ran = DeviceRunner(engine, decoder).run([item], live.current, tasks, [Want(0, 1, 3, True)])
    return ran.cut(Want(0, 1, 3, True), None if adapters is None else ["base", *adapters], 1, 0)


def test_answers_under_load_are_each_images_alone(served) -> None:
    engine, live, decoder, items = served
    loop = EngineLoop(
        live, DeviceRunner(engine, decoder), max_batch=MAX_BATCH, max_wait=0.002, max_queue=4096,
        metrics=Metrics(), warm=lambda adapters: warm_up(engine, adapters, MAX_BATCH, 64),
    )  # fmt: skip
    assert loop.depth == 3
    loop.start()  # captures the graphs first
    graphs = engine._graphs()
    captured = graphs.captures
    assert captured > 0
    rng = random.Random(0)
    asks = [None, ("a0",), ("a1", "a3"), ()]
    jobs = []
    try:
        for _ in range(300):  # closed loop from a few threads would do as well: the queue is deep
            item, adapters = rng.choice(items), rng.choice(asks)
            future: Future = Future()
            tasks = None if adapters is None else ["base", *adapters]
            job = Job([item], adapters, tasks, SINK, top_k=3, logits=True, context=future)
            loop.submit(job)
            jobs.append((item, adapters, future))
        answers = [(item, adapters, future.result(120)) for item, adapters, future in jobs]
    finally:
        loop.stop()
    # Several tasks per image, and every adapter beside one, are shapes warm-up does not capture
    # (server/inference/warmup.py): their first passes run eagerly (checked below with the rest) while
    # the engine-graphs thread captures them; nothing is captured on the serving path.
    assert graphs.captures == captured and graphs.eager_passes > 0 and graphs.captures_beside > 0
    for item, adapters, answer in answers:
        expected = alone(engine, live, decoder, item, adapters)
        assert answer.tasks == expected.tasks
        for t in range(len(answer.tasks)):
            got, want = torch.from_numpy(answer.task_logits(t)), torch.from_numpy(expected.task_logits(t))
            assert (got - want).abs().max() <= 1e-3, (item.name, answer.tasks[t])


def test_the_engine_loop_keeps_three_batches_in_flight(served) -> None:
    engine, live, decoder, items = served
    runner = DeviceRunner(engine, decoder)
    loop = EngineLoop(live, runner, max_batch=4, max_wait=0.0, max_queue=4096, metrics=Metrics())
    lock, state = threading.Lock(), {"open": 0, "most": 0}
    launch, collect = runner.launch, runner.collect

    def launching(*args):
        torch.cuda._sleep(20_000_000)  # a slow device: the pass queued behind ~10 ms; the host runs ahead
        launched = launch(*args)
        with lock:
            state["open"] += 1
            state["most"] = max(state["most"], state["open"])
        return launched

    def collecting(launched):
        ran = collect(launched)
        with lock:
            state["open"] -= 1
        return ran

    runner.launch, runner.collect = launching, collecting
    futures = []
    for i in range(40):
        future: Future = Future()
        loop.submit(Job([items[i % len(items)]], None, None, SINK, context=future))
        futures.append(future)
    loop.start()
    try:
        for future in futures:
            future.result(120)
    finally:
        loop.stop()
    assert state["most"] >= 2  # launched and not yet read back: the host ran ahead of the device


def test_an_install_that_grows_the_pools_captures_beside_serving(tiny_weights, caplog) -> None:
    """On the GPU, what tests/server/inference/test_warmup.py shows with stand-in graphs: an install
    past the pools' slots and classes under load captures the grown pools' graphs on the installing
    thread (thread-local capture mode, beside the decode stream's and the collector's work) while
    the loop replays the old ones; nothing is captured while serving; every answer is its image's
    alone, by the same weights on the CPU."""
    engine = MemoryViT.from_timm(weights=tiny_weights, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    exact_float32(engine.device, engine.dtype)  # as the server does
    try:
        grown_beside_serving(engine, caplog)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def grown_beside_serving(engine, caplog) -> None:
    answered, asked, while_serving, weights, decoder = grow_under_load(engine, "cuda", clients=8)
    assert answered and answered[0] > 0 and while_serving == 0
    assert engine._graphs().captures_beside > 0
    assert "a CUDA graph captured while serving" not in caplog.text
    reference = LiveAdapters(engine)  # the same engine, eagerly: graphs off
    engine.cuda_graphs = False
    try:
        reference.replace_all(weights)
        check_alone(asked, reference, decoder, 1e-3)
    finally:
        engine.cuda_graphs = True
