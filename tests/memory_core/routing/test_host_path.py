"""A graphed pass's host path (memory_core/routing/: graphs, plan, staging), on this CPU with the replay
stubbed (benchmarks/host_counts.py): a fixed handful of aten ops whatever the tasks, no host sync,
no event created once warm, and host buffers reused, never waited for."""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_counts import HostCounts, StandInEvent, counting
from benchmarks.host_path import routed_asks, stand_in_engine
from memvit.memory_core.routing.staging import HostBuffers
from tests.conftest import TOL, max_diff, random_adapter


@pytest.fixture(scope="module")
def resident():
    return stand_in_engine(300)


def one_pass(engine, graphs, x, adapter_set, tasks) -> HostCounts:
    with torch.inference_mode():
        engine(x, adapter_set, tasks=tasks)  # captures what it needs
        counts = HostCounts(device_tensors=[x])
        with counting(counts, graphs):
            engine(x, adapter_set, tasks=tasks)
    return counts


@pytest.mark.parametrize("batch", [3, 16])
def test_a_pass_is_a_few_ops_whatever_the_tasks_and_never_syncs(resident, batch: int) -> None:
    engine, live, graphs = resident
    x = torch.randn(batch, 3, *engine.spec.img_size)
    cases = {
        "base": (None, None),
        "all 300": (live.current, None),
        "routed 1": (live.current, routed_asks(live, 1, batch, seed=0)),
        "routed 8": (live.current, routed_asks(live, 8, batch, seed=1)),
        "by names": (live.current, [[live.current.names[i]] for i in range(batch)]),
    }
    ops = {}
    for case, (adapter_set, tasks) in cases.items():
        counts = one_pass(engine, graphs, x, adapter_set, tasks)
        assert counts.syncs == 0, (case, counts.ops)
        assert counts.events_created == 0, case
        assert not counts.host_ops, (case, counts.host_ops)  # no CPU kernel (on a GPU's host)
        ops[case] = counts.aten_ops
    assert ops["base"] <= 2 and max(ops.values()) <= 6, ops
    routed = {n for case, n in ops.items() if case not in ("base", "all 300")}
    assert len(routed) == 1, ops  # the same for any tasks
    # The set's kept all-tasks plan is in the graph already: no copy of it, one more output.
    assert ops["all 300"] == ops["base"] + 1 == min(routed) - 1, ops


def test_an_op_on_host_tensors_alone_is_counted_as_a_host_op(resident) -> None:
    engine, _, graphs = resident
    x = torch.randn(2, 3, *engine.spec.img_size)
    counts = HostCounts(device_tensors=[x])
    with counting(counts, graphs):
        x.mul_(1.0)  # a device tensor's op: not a host op
        torch.ones(3).add_(1.0)  # a CPU kernel on any host
    assert counts.host_ops == {"aten.ones": 1, "aten.add_": 1}, counts.host_ops


@pytest.mark.parametrize("ahead", [False, True], ids=["one graph", "embedding ahead"])
@pytest.mark.parametrize("per_image", [0, 2, 40])
def test_the_graph_path_answers_what_the_eager_pass_answers(per_image: int, ahead: bool) -> None:
    """What the host puts in a graph's static inputs (images, the plan from its host buffer) is what
    the eager pass reads: the stand-in replays by running the pass again over them. Ahead: the
    embedding's graph replayed before the plan, the pass's graph reading its tokens."""
    engine, live, graphs = stand_in_engine(40, replays=True)
    engine.embed_ahead = ahead
    x = torch.randn(5, 3, *engine.spec.img_size)
    if per_image == 40:
        tasks = None  # every adapter, the shared layout
    elif per_image:
        tasks = routed_asks(live, per_image, 5, seed=3)
    else:
        tasks = [[] for _ in range(5)]  # nobody asks: the base alone
    with torch.inference_mode():
        engine(torch.randn_like(x), live.current, tasks=tasks)  # another batch first: nothing stale
        graphed = engine(x, live.current, tasks=tasks)
        engine.cuda_graphs = False
        try:
            eager = engine(x, live.current, tasks=tasks)
        finally:
            engine.cuda_graphs = True
    # Nobody asking is the base pass: one graph, ahead or not.
    assert any(key[0][0] == "embed" for key in graphs._graphs) == (ahead and per_image > 0)
    assert len(graphed) == 5 and max_diff(graphed.base, eager.base) <= TOL
    assert list(graphed.adapters) == list(eager.adapters)
    for name in eager.adapters:
        assert max_diff(graphed.adapters[name], eager.adapters[name]) <= TOL


def test_host_buffers_are_reused_once_their_copy_has_run_and_never_waited_for() -> None:
    class Pending(StandInEvent):
        done = False

        def query(self) -> bool:
            return Pending.done

    created = StandInEvent.created
    buffers = HostBuffers(pinned=False, new_event=Pending)
    target = torch.empty(4, dtype=torch.long)
    first = buffers.acquire(4)
    first.array[:] = [1, 2, 3, 4]
    buffers.send(first, target)
    assert target.tolist() == [1, 2, 3, 4]
    second = buffers.acquire(4)  # the first copy has not run: another buffer, no wait
    assert second is not first and len(buffers) == 2
    buffers.release(second)
    assert buffers.acquire(4) is second  # released unsent: free at once
    Pending.done = True
    assert buffers.acquire(4) is first  # its copy has run
    assert StandInEvent.created - created == 2 and StandInEvent.synchronized == 0  # one event per buffer


def test_a_buffer_is_given_back_when_the_pass_fails(resident) -> None:
    engine, live, graphs = resident
    x = torch.randn(2, 3, *engine.spec.img_size)
    before = len(graphs.buffers)
    with torch.inference_mode():
        for _ in range(5):
            with pytest.raises(Exception, match="no adapter named"):
                engine(x, live.current, tasks=[["nope"], []])
            engine(x, live.current, tasks=[[live.current.names[0]], []])
    assert len(graphs.buffers) <= before + 1  # the ring does not grow with the passes


@pytest.mark.parametrize("ahead", [False, True], ids=["one graph", "embedding ahead"])
def test_a_kept_plan_is_sent_again_after_another_plan_of_its_shape(ahead: bool) -> None:
    """The all-tasks plan is not copied to a graph that holds it; a shared plan of the same shape
    (every image asking for 33 of the 40: 64 rows either way) replaces it there, and the next
    all-tasks pass must send it again."""
    engine, live, graphs = stand_in_engine(40, replays=True, ahead=ahead)
    other = engine.prepare_set(random_adapter(f"b{i}", engine, m=1, classes=10) for i in range(40))
    x = torch.randn(3, 3, *engine.spec.img_size)
    subset = [list(live.current.names[:33])] * 3
    with torch.inference_mode():
        runs = [
            engine(x, live.current),
            engine(x, live.current, tasks=subset),
            engine(x, live.current),
            engine(x, other),  # another set's kept plan, of the same shape
            engine(x, live.current),
        ]
        engine.cuda_graphs = False
        try:
            eager = [engine(x, live.current), engine(x, live.current, tasks=subset), engine(x, other)]
        finally:
            engine.cuda_graphs = True
    # One shape: one graph for every plan (ahead, beside the patch embedding's own).
    assert len(graphs) == 1 + ahead
    for got, expected in zip(runs, [eager[0], eager[1], eager[0], eager[2], eager[0]], strict=True):
        assert list(got.adapters) == list(expected.adapters)
        for name in expected.adapters:
            assert max_diff(got.adapters[name], expected.adapters[name]) <= TOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_copy_records_its_event_on_the_stream_current_when_sent() -> None:
    buffers = HostBuffers()
    device = torch.device("cuda", torch.cuda.current_device())
    assert buffers._current_stream(device) == torch.cuda.current_stream()
    assert buffers._current_stream(device) is buffers._current_stream(device)  # kept, not rebuilt
    side = torch.cuda.Stream()
    target = torch.empty(3, dtype=torch.long, device=device)
    with torch.cuda.stream(side):
        assert buffers._current_stream(device) == side
        buffer = buffers.acquire(3)
        buffer.array[:] = [7, 8, 9]
        buffers.send(buffer, target)
        side.synchronize()
    assert buffer.event.query() and target.tolist() == [7, 8, 9]
    assert buffers.acquire(3) is buffer  # its copy has run: the same buffer again
