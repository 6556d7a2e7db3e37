"""The dynamic batcher on its own: batches form from requests that are on their way, and a lone
request does not wait for company that is not coming."""

from __future__ import annotations

import asyncio
import time

import torch

from server.batching import DynamicBatcher
from server.metrics import Metrics
from tests.conftest import images


def _batcher(engine, max_wait: float) -> tuple[DynamicBatcher, list[int]]:
    batcher = DynamicBatcher(engine, max_batch=8, max_wait=max_wait, max_queue=64, metrics=Metrics())
    sizes: list[int] = []
    forward = batcher._forward

    def counting(x, adapter_set):
        sizes.append(x.shape[0])
        return forward(x, adapter_set)

    batcher._forward = counting
    return batcher, sizes


def test_a_lone_request_runs_without_waiting_out_max_wait(engine) -> None:
    async def main() -> float:
        batcher, sizes = _batcher(engine, max_wait=3.0)
        await batcher.start()
        try:
            start = time.perf_counter()
            result = await batcher.submit(images(engine, 1))
            assert result.base.shape[0] == 1 and sizes == [1]
            return time.perf_counter() - start
        finally:
            await batcher.stop()

    assert asyncio.run(main()) < 1.5  # would be >= 3 s if the batch waited for nobody


def test_announced_requests_join_the_batch(engine) -> None:
    x = images(engine, 3)

    async def main() -> list[int]:
        batcher, sizes = _batcher(engine, max_wait=3.0)
        await batcher.start()
        try:
            with batcher.expecting(2):  # two images still "decoding"
                first = asyncio.create_task(batcher.submit(x[:1]))
                await asyncio.sleep(0.3)  # the gatherer holds the first one, waiting for these
                assert not first.done()
                second = x[1:]
            results = await asyncio.gather(first, batcher.submit(second))
            torch.testing.assert_close(torch.cat([r.base for r in results]), engine(x).base)
            assert results[0].adapter_set is results[1].adapter_set
            return sizes
        finally:
            await batcher.stop()

    assert asyncio.run(main()) == [3]
