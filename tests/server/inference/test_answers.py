"""A batch's answers (server/inference/answers.py): computed for the batch at once, cut per request, they are
what each task's own softmax and top-k give, whatever else shares the batch; padded classes never
show; a non-finite logit is refused, never answered."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import BASE_TASK, FusedOutput, LiveAdapters
from memvit.server.errors import NonFiniteOutputError
from memvit.server.inference.answers import BatchAnswers, Want
from tests.conftest import random_adapter, tiny_engine


@pytest.fixture(scope="module")
def setup():
    engine = tiny_engine()
    live = LiveAdapters(engine)
    # Different class counts: every row of the batch's table is padded to the widest (9).
    live.replace_all([random_adapter(n, engine, m=2, classes=c) for n, c in (("a", 3), ("b", 9), ("c", 5))])
    return engine, live.current


def reference(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = values.softmax(-1).topk(min(k, values.shape[-1]), dim=-1)
    return top.values, top.indices


def test_a_routed_batch_cut_per_request_is_each_tasks_own_softmax_and_top_k(setup) -> None:
    engine, adapters = setup
    x = torch.randn(5, 3, 32, 32)
    tasks = [("a",), ("a",), ("b", "c"), (), ("a", "b", "c")]
    out = engine(x, adapters, tasks=tasks)
    wants = [Want(0, 2, 2, True), Want(2, 3, 7, False), Want(3, 4, 1, True), Want(4, 5, 20, True)]
    batch = BatchAnswers(out, engine.labels, wants)
    batch.wait()
    asked = [["a", "base"], ["c", "b", "c"], ["base"], None]
    for want, request in zip(wants, asked, strict=True):
        answer = batch.cut(want, request, version=7, registered=3)
        expected_tasks = ("base", "a", "b", "c") if request is None else tuple(dict.fromkeys(request))
        assert answer.tasks == expected_tasks and (answer.version, answer.registered) == (7, 3)
        n = want.hi - want.lo
        assert answer.probs.shape[:2] == (n, len(expected_tasks))
        for t, task in enumerate(expected_tasks):
            full = out.base if task == BASE_TASK else out.adapters[task]
            rows = torch.arange(want.lo, want.hi) if task == BASE_TASK else _rows(out, task, want)
            values = full[rows]
            assert answer.classes[t] == values.shape[1]
            probs, index = reference(values, want.top_k)
            k = probs.shape[1]
            torch.testing.assert_close(torch.from_numpy(answer.probs[:, t, :k]), probs)
            assert torch.equal(torch.from_numpy(answer.index[:, t, :k]), index)
            if want.logits:
                assert torch.equal(torch.from_numpy(answer.task_logits(t)), values)
            labels = engine.labels if task == BASE_TASK else adapters[task].weights.labels
            assert answer.labels[t] == labels
        assert (answer.logits is None) != want.logits


def _rows(out: FusedOutput, task: str, want: Want) -> torch.Tensor:
    images = out.images[task]
    return torch.nonzero((images >= want.lo) & (images < want.hi)).flatten()


def test_an_unrouted_batch_answers_every_adapter_and_the_base(setup) -> None:
    engine, adapters = setup
    out = engine(torch.randn(3, 3, 32, 32), adapters)
    batch = BatchAnswers(out, engine.labels, [Want(0, 3, 5, False)])
    batch.wait()
    answer = batch.cut(Want(1, 3, 5, False), None, 1, 3)
    assert answer.tasks == ("base", "a", "b", "c") and answer.logits is None
    for t, task in enumerate(answer.tasks):
        values = out.logits()[task][1:3]
        probs, index = reference(values, 5)
        assert torch.equal(torch.from_numpy(answer.index[:, t, : probs.shape[1]]), index)


def test_no_top_k_and_the_base_alone(setup) -> None:
    engine, _ = setup
    out = engine(torch.randn(2, 3, 32, 32))
    batch = BatchAnswers(out, engine.labels, [Want(0, 2, 0, True)])
    batch.wait()
    answer = batch.cut(Want(0, 2, 0, True), ["base"], 1, 0)
    assert answer.probs.shape == (2, 1, 0) and torch.equal(torch.from_numpy(answer.task_logits(0)), out.base)


def test_a_non_finite_logit_is_refused_naming_its_task(setup) -> None:
    engine, adapters = setup
    out = engine(torch.randn(2, 3, 32, 32), adapters)
    broken = dict(out.adapters)
    broken["b"] = broken["b"].clone()
    broken["b"][1, 0] = float("nan")
    out = FusedOutput.every_image(out.base, broken, adapters)
    batch = BatchAnswers(out, engine.labels, [Want(0, 1, 3, False), Want(1, 2, 3, False)])
    batch.wait()
    assert batch.cut(Want(0, 1, 3, False), ["b"], 1, 3).tasks == ("b",)  # its own rows are finite
    batch.cut(Want(1, 2, 3, False), ["a", "c"], 1, 3)  # and the other tasks of the image too
    with pytest.raises(NonFiniteOutputError, match="task 'b' produced non-finite logits"):
        batch.cut(Want(1, 2, 3, False), ["a", "b"], 1, 3)


def test_a_batch_without_padding_is_each_tasks_own_softmax_and_top_k_bit_for_bit() -> None:
    """Every task as wide as the base: no row is padded, so no mask is built (a mask of nothing
    leaves the table as it is); each answer is its task's own softmax and top-k, bit for bit."""
    engine = tiny_engine()
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(n, engine, m=2, classes=engine.base.num_classes) for n in ("a", "b")])
    out = engine(torch.randn(4, 3, 32, 32), live.current)
    wants = [Want(0, 2, 3, True), Want(2, 4, 5, False)]
    batch = BatchAnswers(out, engine.labels, wants)
    batch.wait()
    for want in wants:
        answer = batch.cut(want, None, 1, 2)
        for t, task in enumerate(answer.tasks):
            probs, index = reference(out.logits()[task][want.lo : want.hi], want.top_k)
            assert torch.equal(torch.from_numpy(answer.probs[:, t]), probs)
            assert torch.equal(torch.from_numpy(answer.index[:, t]), index)


def test_batches_of_one_kept_plan_share_its_layout_and_answer_their_own_logits(setup) -> None:
    """An unfiltered batch of one size runs the plan kept for it (``plan_pass``): its layout (rows,
    classes, columns, padding mask) is worked out once, and every batch still answers its own logits."""
    engine, adapters = setup
    wants = [Want(0, 1, 3, True), Want(1, 3, 9, False)]
    batches = []
    for _ in range(3):
        out = engine(torch.randn(3, 3, 32, 32), adapters)
        batch = BatchAnswers(out, engine.labels, wants)
        batch.wait()
        batches.append(batch)
        for want in wants:
            answer = batch.cut(want, ["c", "base", "a"], 1, 3)
            assert answer.tasks == ("c", "base", "a")
            for t, task in enumerate(answer.tasks):
                values = out.logits()[task][want.lo : want.hi]
                probs, index = reference(values, want.top_k)
                torch.testing.assert_close(torch.from_numpy(answer.probs[:, t, : probs.shape[1]]), probs)
                assert torch.equal(torch.from_numpy(answer.index[:, t, : probs.shape[1]]), index)
                if want.logits:
                    assert torch.equal(torch.from_numpy(answer.task_logits(t)), values)
    assert batches[0].rows is batches[1].rows is batches[2].rows  # one layout for the plan


def test_another_snapshot_or_batch_size_gets_its_own_layout(setup) -> None:
    """A layout is its plan's: a new snapshot (other tasks, other classes) or another batch size
    never reads one made for another."""
    engine, adapters = setup
    first = BatchAnswers(engine(torch.randn(2, 3, 32, 32), adapters), engine.labels, [Want(0, 2, 3, False)])
    other = BatchAnswers(engine(torch.randn(3, 3, 32, 32), adapters), engine.labels, [Want(0, 3, 3, False)])
    assert first.rows is not other.rows and other.rows.shape[0] == 3
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(n, engine, m=2, classes=c) for n, c in (("d", 4), ("a", 6))])
    out = engine(torch.randn(2, 3, 32, 32), live.current)
    batch = BatchAnswers(out, engine.labels, [Want(0, 2, 3, False)])
    batch.wait()
    answer = batch.cut(Want(0, 2, 3, False), None, 1, 2)
    assert answer.tasks == ("base", "d", "a") and list(answer.classes) == [engine.base.num_classes, 4, 6]
    for t, task in enumerate(answer.tasks):
        probs, index = reference(out.logits()[task], 3)
        assert torch.equal(torch.from_numpy(answer.index[:, t, : probs.shape[1]]), index)
