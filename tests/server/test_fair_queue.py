"""The fair queue (Virtual Token Counter) and the gate built on it, on their own: who goes next, by
how much service each flow received and its weight; work-conserving; no idle time banked; bounded."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from memvit.server.errors import OverloadedError
from memvit.server.fair_queue import FairGate, FairQueue


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


def test_the_gate_lets_waiters_in_by_service_and_skips_those_gone() -> None:
    async def main() -> list[str]:
        gate = FairGate(slots=1)
        order: list[str] = []

        async def work(flow: str, name: str) -> None:
            async with gate.turn(flow):
                order.append(name)
                await asyncio.sleep(0)

        await gate.enter("heavy")  # the slot is taken: everyone below waits
        heavy = [asyncio.create_task(work("heavy", f"h{i}")) for i in range(5)]
        await asyncio.sleep(0)
        gone = asyncio.create_task(work("gone", "g0"))
        await asyncio.sleep(0)
        light = asyncio.create_task(work("light", "l0"))
        await asyncio.sleep(0)
        gone.cancel()  # a client that went away while waiting
        await asyncio.sleep(0)
        assert gate.busy == 1 and not order
        gate.leave()
        await asyncio.gather(*heavy, light)
        assert gate.busy == 0 and gate.waiting == 0
        return order

    order = asyncio.run(main())
    assert "g0" not in order
    assert order.index("l0") <= 1, order  # not behind heavy's five


def test_a_bounded_gate_refuses_a_flow_over_its_share() -> None:
    async def main() -> None:
        gate = FairGate(slots=1, max_waiting=2)
        await gate.enter("a")
        waiting = [asyncio.create_task(gate.enter("a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError):
            await gate.enter("a")
        other = asyncio.create_task(gate.enter("b"))  # below its share of the waiting room: let in
        await asyncio.sleep(0)
        assert gate.waiting == 3
        for task in (*waiting, other):
            task.cancel()

    asyncio.run(main())
