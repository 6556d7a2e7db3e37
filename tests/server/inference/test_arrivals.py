"""A forming batch's wait for requests not announced (server/inference/arrivals.py): none for a lone
request or after a pause, a few mean gaps while requests arrive densely, never past ``max_wait``; and
in the engine loop, requests arriving close together share a batch none of them announced."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from memvit.memory_core import LiveAdapters
from memvit.server.inference.arrivals import LONGEST, ArrivalGap
from tests.conftest import images
from tests.server.inference.test_engine_loop import engine_loop, submit


def test_no_wait_before_requests_arrive_densely() -> None:
    gap = ArrivalGap(2.0)
    assert gap.wait(0.005) == 0.0  # nothing seen yet
    gap.arrived(0.0)
    assert gap.wait(0.005) == 0.0  # one request: no gap known


def test_dense_arrivals_wait_a_few_gaps_within_the_deadline() -> None:
    gap = ArrivalGap(2.0)
    for i in range(60):
        gap.arrived(i * 0.001)  # one a millisecond
    assert gap.mean == pytest.approx(0.001, rel=0.01)
    assert gap.wait(0.005) == pytest.approx(0.002, rel=0.01)
    assert gap.wait(0.0015) == pytest.approx(0.0015)  # never past the batch's deadline
    assert gap.wait(0.0009) == 0.0  # the next one is not expected before it
    assert gap.wait(0.0) == 0.0


def test_a_pause_ends_the_wait_and_off_is_off() -> None:
    gap = ArrivalGap(2.0)
    for i in range(60):
        gap.arrived(i * 0.001)
    gap.arrived(10.0)  # a pause: the request after it goes alone, whatever the mean
    assert gap.wait(0.005) == 0.0 and gap.wait(0.5) == 0.0
    assert gap.mean <= LONGEST
    off = ArrivalGap(0.0)
    for i in range(60):
        off.arrived(i * 0.001)
    assert off.wait(0.005) == 0.0


def _arrivals(loop, x, n: int, every: float) -> list[Future]:
    futures: list[Future] = []
    for i in range(n):
        futures.append(submit(loop, x[i : i + 1]))
        time.sleep(every)
    return futures


def test_requests_arriving_close_together_share_a_batch(engine) -> None:
    """Nothing announced: with the linger, requests a few ms apart join one batch (up to max_wait);
    without it, each goes alone as soon as the batcher is free."""
    x = images(engine, 8)
    for linger in (3.0, 0.0):
        loop, sizes = engine_loop(LiveAdapters(engine), max_wait=0.5, linger=linger)
        loop.start()
        try:
            for future in _arrivals(loop, x, 8, 0.02):  # a gap of 20 ms: the mean once it is known
                future.result(10)
            sizes.clear()
            futures = _arrivals(loop, x, 6, 0.02)
            for future in futures:
                future.result(10)
        finally:
            loop.stop()
        assert sum(s for s, _ in sizes) == 6
        largest = max(s for s, _ in sizes)
        # 6 requests 20 ms apart: one batch within max_wait with the linger; without it, each goes
        # as it comes (two only if a pass took longer than the gap on a loaded machine)
        assert largest >= 4 if linger else largest <= 3, (linger, sizes)


def test_a_request_after_a_pause_goes_at_once(engine) -> None:
    x = images(engine, 8)
    loop, _ = engine_loop(LiveAdapters(engine), max_wait=0.8, linger=3.0)
    loop.start()
    try:
        for future in _arrivals(loop, x, 6, 0.01):
            future.result(10)
        time.sleep(1.2)  # a pause longer than LONGEST
        start = time.perf_counter()
        submit(loop, x[:1]).result(10)
        assert time.perf_counter() - start < 0.4  # >= 0.8 s had it waited out max_wait
    finally:
        loop.stop()
