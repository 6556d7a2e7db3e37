"""The dynamic batcher on its own: batches form from requests that are on their way, and a lone
request does not wait for company that is not coming."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import torch
from PIL import Image

from memvit.memory_core import LiveAdapters
from memvit.server.app import create_app
from memvit.server.batching import DynamicBatcher
from memvit.server.metrics import Metrics
from memvit.server.settings import Settings
from tests.conftest import images
from tests.server.conftest import free_port, running_server


def _batcher(live: LiveAdapters, max_wait: float) -> tuple[DynamicBatcher, list[int]]:
    batcher = DynamicBatcher(live, max_batch=8, max_wait=max_wait, max_queue=64, metrics=Metrics())
    sizes: list[int] = []
    forward = batcher._launch

    def counting(items, adapter_set, tasks=None):
        sizes.append(len(items))
        return forward(items, adapter_set, tasks)

    batcher._launch = counting
    return batcher, sizes


async def _ready(x: torch.Tensor) -> torch.Tensor:
    return x


def test_a_lone_request_runs_without_waiting_out_max_wait(engine) -> None:
    async def main() -> float:
        batcher, sizes = _batcher(LiveAdapters(engine), max_wait=3.0)
        await batcher.start()
        try:
            start = time.perf_counter()
            result = await batcher.run(1, _ready(images(engine, 1)))
            assert result.base.shape[0] == 1 and sizes == [1]
            return time.perf_counter() - start
        finally:
            await batcher.stop()

    assert asyncio.run(main()) < 1.5  # would be >= 3 s if the batch waited for nobody


def test_announced_requests_join_the_batch(engine) -> None:
    x = images(engine, 3)

    async def main() -> list[int]:
        batcher, sizes = _batcher(LiveAdapters(engine), max_wait=3.0)
        await batcher.start()
        try:
            decoded = asyncio.get_running_loop().create_future()
            second = asyncio.create_task(batcher.run(2, decoded))  # two images still "decoding"
            await asyncio.sleep(0.05)
            first = asyncio.create_task(batcher.run(1, _ready(x[:1])))
            await asyncio.sleep(0.3)  # the gatherer holds the first one, waiting for these
            assert not first.done()
            decoded.set_result(x[1:])
            results = await asyncio.gather(first, second)
            torch.testing.assert_close(torch.cat([r.base for r in results]), engine(x).base)
            assert results[0].adapter_set is results[1].adapter_set
            return sizes
        finally:
            await batcher.stop()

    assert asyncio.run(main()) == [3]


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


def test_requests_with_different_tasks_share_one_routed_pass(engine) -> None:
    from memvit.memory_core import UnknownAdapterError
    from memvit.server.errors import UnknownTaskError
    from tests.conftest import random_adapter

    live = LiveAdapters(engine)
    live.replace_all([random_adapter(n, engine, m=i) for i, n in enumerate(("a", "b", "c"))])
    x = images(engine, 6)
    full = engine(x, live.current)

    async def main():
        batcher, sizes = _batcher(live, max_wait=0.5)
        routed: list = []
        forward = batcher._launch

        def spy(items, adapter_set, tasks=None):
            routed.append(tasks)
            return forward(items, adapter_set, tasks)

        batcher._launch = spy
        await batcher.start()
        try:
            jobs = [
                batcher.run(2, _ready(x[0:2]), ["a"]),
                batcher.run(1, _ready(x[2:3]), ["b", "c"]),
                batcher.run(1, _ready(x[3:4]), None),  # every adapter
                batcher.run(1, _ready(x[4:5]), []),  # the base task only
                batcher.run(1, _ready(x[5:6]), ["gone"]),  # removed while it waited
            ]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            return results, sizes, routed
        finally:
            await batcher.stop()

    results, sizes, routed = asyncio.run(main())
    assert sizes == [5]  # one pass, without the job that failed
    assert isinstance(results[4], UnknownTaskError) and "gone" in str(results[4])
    assert not isinstance(results[4], UnknownAdapterError)
    assert routed == [[("a",), ("a",), ("b", "c"), ("a", "b", "c"), ()]]  # per image, the set's order
    expected_tasks = [{"a"}, {"b", "c"}, {"a", "b", "c"}, set()]
    offsets = [0, 2, 3, 4]
    for result, asked, start in zip(results[:4], expected_tasks, offsets, strict=True):
        assert set(result.adapters) == asked  # exactly its tasks
        for name, logits in result.adapters.items():
            n = result.base.shape[0]
            assert result.images[name].tolist() == list(range(n))
            torch.testing.assert_close(logits, full.adapters[name][start : start + n], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            result.base, full.base[start : start + result.base.shape[0]], atol=1e-5, rtol=0
        )


def _marked(engine, value: float) -> torch.Tensor:
    """One image whose first pixel says whose it is."""
    x = images(engine, 1)
    x[0, 0, 0, 0] = value
    return x


def _fair_run(
    engine, fair: bool, jobs: list[tuple[str, float]], max_batch: int, weights: dict | None = None
) -> list[list[str]]:
    """``jobs`` (flow, marker) queued while the first pass is held; the flows of each pass after it."""
    weights = weights or {}
    held = threading.Event()
    passes: list[list[float]] = []

    async def main() -> None:
        live = LiveAdapters(engine)
        batcher = DynamicBatcher(
            live, max_batch=max_batch, max_wait=0, max_queue=1000, metrics=Metrics(), fair=fair
        )
        forward = batcher._launch

        def recording(items, adapter_set, tasks=None):
            passes.append([float(item[0, 0, 0]) for item in items])
            if len(passes) == 1:
                held.wait(30)  # the first pass runs until everything else is queued
            return forward(items, adapter_set, tasks)

        batcher._launch = recording
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.run(1, _ready(_marked(engine, -1.0)), flow="first"))
            while not passes:
                await asyncio.sleep(0.01)
            runs = []
            for flow, marker in jobs:
                job = batcher.run(
                    1, _ready(_marked(engine, marker)), flow=flow, weight=weights.get(flow, 1.0)
                )
                runs.append(asyncio.create_task(job))
            await asyncio.sleep(0.05)  # every job queued behind the held pass
            held.set()
            await asyncio.gather(first, *runs)
        finally:
            await batcher.stop()

    asyncio.run(main())
    flow_of = {m: f for f, m in jobs}
    return [[flow_of[v] for v in p] for p in passes[1:]]


def test_a_light_key_is_served_in_the_next_pass_not_after_a_backlog(engine) -> None:
    """The queue the batcher forms passes from is fair (server/fair_queue.py): a key with one request
    waiting goes in the next pass, not behind another key's 12; with fairness off, behind them."""
    jobs = [("heavy", float(i)) for i in range(12)] + [("light", 100.0)]
    fair = _fair_run(engine, True, jobs, max_batch=4)
    assert "light" in fair[0], fair
    fifo = _fair_run(engine, False, jobs, max_batch=4)
    assert "light" in fifo[-1] and "light" not in fifo[0], fifo


def test_backlogged_keys_share_passes_by_weight(engine) -> None:
    jobs = [(flow, float(i * 2 + j)) for i in range(24) for j, flow in enumerate(("one", "three"))]
    passes = _fair_run(engine, True, jobs, max_batch=4, weights={"one": 1.0, "three": 3.0})
    for p in passes[:5]:  # while both wait: 3 of every 4 images to the key of weight 3
        assert sorted(p) == ["one", "three", "three", "three"], passes


def test_two_batches_are_in_flight_when_the_device_runs_them_apart(engine) -> None:
    """On a GPU a launch returns before its pass has run and another thread collects it: the next
    batch is launched meanwhile, but never a third (a stand-in for the CUDA event makes a CPU
    launch look like a GPU's)."""
    x = images(engine, 4)
    lock, state = threading.Lock(), {"uncollected": 0, "most": 0}
    second = threading.Event()

    class Pending:  # the batch's "done" event: collected once the next batch has been launched
        def synchronize(self) -> None:
            second.wait(5)
            with lock:
                state["uncollected"] -= 1

    async def main() -> list:
        batcher = DynamicBatcher(
            LiveAdapters(engine), max_batch=1, max_wait=0, max_queue=64, metrics=Metrics()
        )
        batcher._in_flight = asyncio.Semaphore(2)  # as on CUDA
        launch = batcher._launch

        def launching(items, adapter_set, tasks=None):
            launched = launch(items, adapter_set, tasks)
            with lock:
                state["uncollected"] += 1
                state["most"] = max(state["most"], state["uncollected"])
                if state["uncollected"] == 2:
                    second.set()
            launched.done = Pending()
            return launched

        batcher._launch = launching
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.run(1, _ready(x[i : i + 1])) for i in range(4)))
        finally:
            await batcher.stop()

    outputs = asyncio.run(main())
    assert second.is_set() and state["most"] == 2 and state["uncollected"] == 0
    expected = engine(x).base
    for i, out in enumerate(outputs):
        assert torch.allclose(out.base, expected[i : i + 1], atol=1e-5)
