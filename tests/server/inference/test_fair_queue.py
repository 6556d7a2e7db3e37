"""The fair queue (Virtual Token Counter) and the pool built on it, on their own: who goes next, by
how much service each flow received and its weight; work-conserving; no idle time banked; bounded."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from memvit.server.inference.fair_queue import FairPool, FairQueue


def drain(queue: FairQueue, n: int | None = None) -> list:
    out = []
    while queue.peek() is not None and (n is None or len(out) < n):
        out.append(queue.pop())
    return out


def test_a_lone_flow_gets_every_job_in_its_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(5):
        queue.put("a", f"a{i}", 1 + i % 3)
    assert drain(queue) == [f"a{i}" for i in range(5)]  # work-conserving, first come within a flow
    with pytest.raises(IndexError):
        queue.pop()


def test_a_light_flow_does_not_wait_behind_a_backlog() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(30):
        queue.put("heavy", f"h{i}", 1)
    queue.put("light", "l0", 1)
    order = drain(queue)
    # Both start level: the heavy flow's first job (it came first), then the light one's.
    assert order.index("l0") == 1
    # And a first-come queue would have made it last: the same jobs in one flow.
    fifo: FairQueue[str] = FairQueue()
    for job in [f"h{i}" for i in range(30)] + ["l0"]:
        fifo.put("*", job, 1)
    assert drain(fifo).index("l0") == 30


@pytest.mark.parametrize("weights", [(1, 1), (1, 3), (2, 5)])
def test_backlogged_flows_share_by_weight(weights) -> None:
    """Both always waiting: over any prefix, each flow's images stay within one job of its share."""
    wa, wb = weights
    queue: FairQueue[tuple[str, int]] = FairQueue()
    rng = random.Random(0)
    sizes = {flow: [rng.choice([1, 2, 4]) for _ in range(400)] for flow in "ab"}
    for i in range(400):
        queue.put("a", ("a", sizes["a"][i]), sizes["a"][i], wa)
        queue.put("b", ("b", sizes["b"][i]), sizes["b"][i], wb)
    served: Counter[str] = Counter()
    for _ in range(300):
        flow, size = queue.pop()
        served[flow] += size
        # The Virtual Token Counter's bound: service / weight differs by at most one job's worth (4).
        assert abs(served["a"] / wa - served["b"] / wb) <= 4 + 1e-9
    share_b = served["b"] / (served["a"] + served["b"])
    assert share_b == pytest.approx(wb / (wa + wb), abs=0.02)


def test_time_spent_idle_is_not_banked() -> None:
    """A flow served a lot while alone, then joined by another: they share from then on, rather than
    the newcomer taking every job until its counter catches up."""
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.put("old", f"o{i}", 1)
    drain(queue)  # 100 images to "old" while "new" was idle
    for i in range(10):
        queue.put("old", f"o{i}", 1)
        queue.put("new", f"n{i}", 1)
    first = drain(queue, 10)
    assert 4 <= sum(job.startswith("n") for job in first) <= 6, first


def test_a_returning_flow_is_lifted_to_the_others() -> None:
    """A flow idle while another was served starts at the waiting flows' level, not below it."""
    queue: FairQueue[str] = FairQueue()
    for i in range(20):
        queue.put("busy", f"b{i}", 1)
    drain(queue, 10)  # busy's counter is 10 now; it still waits
    queue.put("back", "x0", 1)
    queue.put("back", "x1", 1)
    assert queue.counters()["back"] == pytest.approx(10)
    order = drain(queue, 4)
    assert order.count("x0") + order.count("x1") == 2 and order[0] == "b10"


def test_charge_counts_service_taken_without_waiting() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.put("b", "b0", 1)
    queue.put("b", "b1", 1)
    queue.charge("a", 5)  # a took 5 images without queueing (while b waited at 0)
    queue.put("a", "a0", 1)
    assert drain(queue) == ["b0", "b1", "a0"]  # uncharged, a0 would tie b0 and go second
    queue.charge("a", 3, weight=3)  # the weight scales it: 3 images at weight 3 count 1
    assert queue.counters()["a"] == pytest.approx(7)


def test_a_flow_below_its_share_is_admitted_past_the_limit() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(10):
        assert queue.admits("heavy", 1, limit=10)
        queue.put("heavy", f"h{i}", 1)
    assert not queue.admits("heavy", 1, limit=10)  # full, and heavy is over its share
    for i in range(5):  # the light flow's share of 10 among two equal flows: 5
        assert queue.admits("light", 1, limit=10)
        queue.put("light", f"l{i}", 1)
    assert not queue.admits("light", 1, limit=10)
    assert queue.admits("heavier", 3, limit=10, weight=2)  # 2/(1+1+2) of 10 = 5: room for 3


def test_the_pool_runs_calls_in_fair_order_and_skips_those_gone() -> None:
    """One thread, held by the first call: the calls waiting run by their flow's service, a call
    whose caller went away is not run at all, and an error reaches its caller."""
    ran: list[str] = []
    held = threading.Event()

    def call(name: str) -> str:
        ran.append(name)
        if name == "h0":
            held.wait(10)
        if name == "bad":
            raise ValueError("broken image")
        return name

    async def main() -> list:
        with ThreadPoolExecutor(1) as executor:
            pool = FairPool(executor)
            first = pool.submit("heavy", 1.0, call, "h0")
            while not ran:
                await asyncio.sleep(0.001)
            heavy = [pool.submit("heavy", 1.0, call, f"h{i}") for i in range(1, 6)]
            gone = pool.submit("gone", 1.0, call, "g0")
            light = pool.submit("light", 1.0, call, "l0")
            bad = pool.submit("light", 1.0, call, "bad")
            gone.cancel()
            assert pool.waiting == 8
            held.set()
            return await asyncio.gather(first, *heavy, light, bad, return_exceptions=True)

    results = asyncio.run(main())
    assert "g0" not in ran
    assert ran.index("l0") == 2, ran  # after the one running and heavy's next (level, heavy older)
    assert results[:7] == ["h0", "h1", "h2", "h3", "h4", "h5", "l0"]
    assert isinstance(results[7], ValueError) and str(results[7]) == "broken image"
