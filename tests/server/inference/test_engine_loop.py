"""The engine loop on its own (server/inference/engine_loop.py): batches form from requests that are on their
way, a lone request does not wait for company that is not coming, keys share passes fairly, routing
costs what a request asks for, several batches are in flight on a device that runs them apart, and
the graphs are captured again, with the other stages idle, once the slot pools grow."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import Future

import httpx
import pytest
import torch
from PIL import Image

from memvit.memory_core import AdapterSet, LiveAdapters
from memvit.server.errors import OverloadedError, UnknownTaskError
from memvit.server.http.app import create_app
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop, Job
from memvit.server.settings import Settings
from memvit.server.telemetry.metrics import Metrics
from tests.conftest import images, random_adapter
from tests.server.conftest import free_port, running_server


class FutureSink:
    def deliver(self, finished) -> None:
        for job, result in finished:
            if isinstance(result, BaseException):
                job.context.set_exception(result)
            else:
                job.context.set_result(result)


SINK = FutureSink()


def submit(loop: EngineLoop, x: torch.Tensor, adapters=None, tasks=None, announced=False, **kw) -> Future:
    future: Future = Future()
    job = Job(list(x.unbind(0)), adapters, tasks, SINK, top_k=3, logits=True, context=future, **kw)
    loop.submit(job, announced=announced)
    return future


def engine_loop(live: LiveAdapters, max_wait: float = 0.0, lanes: int = 1, **kw) -> tuple[EngineLoop, list]:
    loop = EngineLoop(live, DeviceRunner(live.engine, lanes=lanes), max_batch=8, max_wait=max_wait,
                      max_queue=64, metrics=Metrics(), **kw)  # fmt: skip
    sizes: list = []
    launch = loop.runner.launch

    def counting(decoded, adapter_set, tasks, wants):
        sizes.append((decoded.x.shape[0], tasks))
        return launch(decoded, adapter_set, tasks, wants)

    loop.runner.launch = counting
    return loop, sizes


def test_a_lone_request_runs_without_waiting_out_max_wait(engine) -> None:
    loop, sizes = engine_loop(LiveAdapters(engine), max_wait=3.0)
    loop.start()
    try:
        start = time.perf_counter()
        answer = submit(loop, images(engine, 1)).result(10)
        assert answer.tasks == ("base",) and [s for s, _ in sizes] == [1]
        assert time.perf_counter() - start < 1.5  # >= 3 s if the batch waited for nobody
    finally:
        loop.stop()


def test_announced_requests_join_the_batch(engine) -> None:
    x = images(engine, 3)
    loop, sizes = engine_loop(LiveAdapters(engine), max_wait=3.0)
    loop.start()
    try:
        loop.announce(2)  # two images still "decoding"
        first = submit(loop, x[:1])
        time.sleep(0.3)  # the batcher holds the first one, waiting for them
        assert not first.done()
        second = submit(loop, x[1:], announced=True)
        answers = [first.result(10), second.result(10)]
    finally:
        loop.stop()
    assert [s for s, _ in sizes] == [3]
    expected = engine(x).base
    got = torch.cat([torch.from_numpy(a.task_logits(0)) for a in answers])
    torch.testing.assert_close(got, expected)
    assert answers[0].version == answers[1].version


def test_requests_with_different_tasks_share_one_routed_pass(engine) -> None:
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(n, engine, m=i) for i, n in enumerate(("a", "b", "c"))])
    x = images(engine, 6)
    full = engine(x, live.current)
    loop, sizes = engine_loop(live, max_wait=0.5)
    loop.announce(6)
    jobs = [
        (x[0:2], ("a",), ["a", "base"]),
        (x[2:3], ("b", "c"), ["c", "b"]),
        (x[3:4], None, None),  # every adapter
        (x[4:5], (), ["base"]),  # the base task only
        (x[5:6], ("gone",), ["gone"]),  # removed while it waited
    ]
    futures = [submit(loop, xs, adapters, tasks, announced=True) for xs, adapters, tasks in jobs]
    loop.start()
    try:
        results = [f.exception(10) or f.result() for f in futures]
    finally:
        loop.stop()
    assert [s for s, _ in sizes] == [5]  # one pass, without the job that failed
    routed = sizes[0][1]  # per image, the set positions it asks for
    assert [routed.names(b) for b in range(5)] == [["a"], ["a"], ["b", "c"], ["a", "b", "c"], []]
    assert isinstance(results[4], UnknownTaskError) and "gone" in str(results[4])
    offsets = [0, 2, 3, 4]
    for answer, start in zip(results[:4], offsets, strict=True):
        n = len(answer)
        for t, task in enumerate(answer.tasks):
            values = full.logits()[task][start : start + n]
            torch.testing.assert_close(torch.from_numpy(answer.task_logits(t)), values, atol=1e-5, rtol=0)
    assert results[2].tasks == ("base", "a", "b", "c") and results[1].tasks == ("c", "b")


def test_routing_costs_what_a_request_asks_not_what_is_resident(engine, monkeypatch) -> None:
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"r{i}", engine, m=1) for i in range(40)])
    read = []
    names = AdapterSet.names

    def counted(self):
        read.append(len(self))
        return names.fget(self)

    monkeypatch.setattr(AdapterSet, "names", property(counted))
    loop, _ = engine_loop(live)
    loop.start()
    try:
        submit(loop, images(engine, 2), ("r3", "r7"), ["r3", "r7"]).result(10)
    finally:
        loop.stop()
    assert read == []  # never every resident name for a routed batch


def _fair_run(
    engine, fair: bool, jobs: list[tuple[str, float]], weights: dict | None = None
) -> list[list[str]]:
    """``jobs`` (flow, marker) queued before the loop starts, max_batch 4; the flows of each pass."""
    weights = weights or {}
    loop = EngineLoop(LiveAdapters(engine), DeviceRunner(engine), max_batch=4, max_wait=0, max_queue=1000,
                      metrics=Metrics(), fair=fair)  # fmt: skip
    passes: list[list[float]] = []
    decode = loop.runner.decode

    def recording(items, *lane):
        passes.append([float(item[0, 0, 0]) for item in items])
        return decode(items, *lane)

    loop.runner.decode = recording
    futures = []
    for flow, marker in jobs:
        x = images(engine, 1)
        x[0, 0, 0, 0] = marker
        futures.append(submit(loop, x, flow=flow, weight=weights.get(flow, 1.0)))
    loop.start()
    try:
        for future in futures:
            future.result(30)
    finally:
        loop.stop()
    flow_of = {m: f for f, m in jobs}
    return [[flow_of[v] for v in p] for p in passes]


def test_a_light_key_is_served_in_the_next_pass_not_after_a_backlog(engine) -> None:
    jobs = [("heavy", float(i)) for i in range(12)] + [("light", 100.0)]
    fair = _fair_run(engine, True, jobs)
    assert "light" in fair[0], fair
    fifo = _fair_run(engine, False, jobs)
    assert "light" in fifo[-1] and "light" not in fifo[0], fifo


def test_backlogged_keys_share_passes_by_weight(engine) -> None:
    jobs = [(flow, float(i * 2 + j)) for i in range(24) for j, flow in enumerate(("one", "three"))]
    passes = _fair_run(engine, True, jobs, weights={"one": 1.0, "three": 3.0})
    for p in passes[:5]:  # while both wait: 3 of every 4 images to the key of weight 3
        assert sorted(p) == ["one", "three", "three", "three"], passes


def test_several_batches_are_in_flight_when_the_device_runs_them_apart(engine) -> None:
    """On a GPU the pass thread queues a batch and moves on while the collector waits for the one
    before: with a depth of 3, three batches are launched and not yet read back at once (a stand-in
    for the device holds the first batch's answers until the third is launched)."""
    loop, _ = engine_loop(LiveAdapters(engine), depth=3)
    loop.max_batch = 1
    lock, state, third = threading.Lock(), {"launched": 0, "collected": 0, "most": 0}, threading.Event()
    launch, collect = loop.runner.launch, loop.runner.collect

    def launching(*args):
        launched = launch(*args)
        with lock:
            state["launched"] += 1
            open_ = state["launched"] - state["collected"]
            state["most"] = max(state["most"], open_)
            if open_ == 3:
                third.set()
        return launched

    def held(launched):
        third.wait(5)  # the device is still running it
        with lock:
            state["collected"] += 1
        return collect(launched)

    loop.runner.launch, loop.runner.collect = launching, held
    x = images(engine, 5)
    futures = [submit(loop, x[i : i + 1]) for i in range(5)]  # queued before the loop starts
    loop.start()
    try:
        answers = [f.result(10) for f in futures]
    finally:
        loop.stop()
    assert state["most"] == 3 and third.is_set()
    for i, answer in enumerate(answers):
        torch.testing.assert_close(torch.from_numpy(answer.task_logits(0)), engine(x[i : i + 1]).base)


@pytest.mark.parametrize("depth, lanes", [(None, 1), (3, 2)], ids=["cpu", "two-decode-threads"])
def test_graphs_are_captured_at_start_and_again_once_the_pools_grow(engine, depth, lanes) -> None:
    live = LiveAdapters(engine)
    warmed: list[tuple[str, ...]] = []
    warm = lambda adapters: warmed.append(tuple(adapters.names)) or 0  # noqa: E731
    loop, _ = engine_loop(live, warm=warm, depth=depth, lanes=lanes)
    loop.start()
    try:
        assert warmed == [()]  # before any stage ran
        submit(loop, images(engine, 1)).result(10)
        assert warmed == [()]  # nothing grew
        live.replace_all([random_adapter("a", engine, m=3)])  # a slot written: the pools grow
        submit(loop, images(engine, 1), ("a",), ["a"]).result(10)
        assert warmed == [(), ("a",)]
    finally:
        loop.stop()


def test_a_full_queue_refuses_at_once(engine) -> None:
    loop, _ = engine_loop(LiveAdapters(engine))
    loop.max_queue = 2
    submit(loop, images(engine, 2))  # not started: it stays queued
    with pytest.raises(OverloadedError):
        submit(loop, images(engine, 1))
    loop.start()
    loop.stop()


def test_over_http_a_request_still_decoding_joins_the_batch(tiny_weights, tmp_path) -> None:
    """The route announces images while they decode: a fast request waits for a slow one in flight."""
    settings = Settings(
        weights=tiny_weights, adapter_store=tmp_path / "store", port=free_port(), max_wait_ms=3000
    )
    app = create_app(settings)
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")

    async def clients(url: str) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            start = time.perf_counter()
            slow = asyncio.create_task(http.post("/classify", files={"image": ("slow.png", png.getvalue())}))
            await asyncio.sleep(0.1)  # the slow one is decoding when the fast one arrives
            fast = await http.post("/classify", files={"image": ("fast.png", png.getvalue())})
            assert fast.status_code == 200 and (await slow).status_code == 200
            return time.perf_counter() - start

    with running_server(settings, app) as url:
        state = app.state.memvit
        pipeline = state.service.pipeline
        decode = pipeline.decoder

        def slow_decoder(data: bytes, name: str = "image"):
            if name == "slow.png":
                time.sleep(0.5)
            return decode(data, name)

        pipeline.decoder = slow_decoder
        elapsed = asyncio.run(clients(url))
        batches = state.metrics.batch_size.collect()[0].samples
    count = next(s.value for s in batches if s.name.endswith("_count"))
    images_seen = next(s.value for s in batches if s.name.endswith("_sum"))
    assert (count, images_seen) == (1, 2), "the fast request should have waited for the slow one"
    assert elapsed < 2.5, "and no longer than the slow one took to arrive (max_wait is 3 s)"
