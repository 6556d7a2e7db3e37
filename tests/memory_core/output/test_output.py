"""FusedOutput (memory_core/output/fused.py): one shape for routed and unrouted passes, sliced per request,
read lazily from one flat logits tensor and a numpy index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memvit.memory_core import FusedOutput, TaskIndex
from tests.conftest import images, random_adapter


def test_unrouted_every_task_answers_every_image_and_slices_as_views(engine) -> None:
    loaded = engine.prepare_set([random_adapter("a", engine, classes=3), random_adapter("b", engine, m=0)])
    x = images(engine, batch=5)
    out = engine(x, loaded)
    assert list(out.images) == ["a", "b"] and out.images["a"].tolist() == [0, 1, 2, 3, 4]
    assert out.flat is not None and out.adapters["a"].data_ptr() >= out.flat.data_ptr()  # cut from flat
    part = out[1:4]
    assert len(part) == 3 and part.adapter_set is loaded
    assert torch.equal(part.base, out.base[1:4])
    for name in ("a", "b"):
        assert torch.equal(part.adapters[name], out.adapters[name][1:4])
        assert part.images[name].tolist() == [0, 1, 2]
        assert part.adapters[name].data_ptr() == out.adapters[name][1:4].data_ptr()  # a view, no copy
    moved = out.to("cpu", torch.float64)
    assert moved.adapters["a"].dtype == torch.float64 and moved.flat.dtype == torch.float64
    assert torch.equal(moved.adapters["b"], out.adapters["b"].double())
    assert out.logits().keys() == {"base", "a", "b"}


def test_a_base_only_pass_has_no_tasks(engine) -> None:
    out = engine(images(engine))
    assert out.adapters == {} and out.images == {} and len(out.adapter_set) == 0
    assert list(out.logits()) == ["base"] and len(out[0:2]) == 2


def test_only_contiguous_slices(engine) -> None:
    out = engine(images(engine))
    with pytest.raises(TypeError, match="contiguous slice"):
        out[0]  # type: ignore[index]
    with pytest.raises(TypeError, match="contiguous slice"):
        out[::2]


def test_every_image_builds_the_unrouted_shape(engine) -> None:
    base, logits = torch.zeros(4, 7), {"t": torch.arange(8.0).reshape(4, 2)}
    out = FusedOutput.every_image(base, logits, engine.prepare_set([]))
    assert out.images["t"].tolist() == [0, 1, 2, 3]
    assert out[3:4].adapters["t"].tolist() == [[6.0, 7.0]] and out[3:4].images["t"].tolist() == [0]


def test_parts_of_a_batch_join_into_the_whole_batchs_output(engine) -> None:
    loaded = engine.prepare_set([random_adapter("a", engine, classes=3), random_adapter("b", engine, m=0)])
    x = images(engine, batch=5)
    tasks = [["a"], [], ["a", "b"], ["b"], ["a"]]
    whole = engine(x, loaded, tasks=tasks)
    joined = FusedOutput.cat([engine(x[:2], loaded, tasks=tasks[:2]), engine(x[2:], loaded, tasks=tasks[2:])])
    assert torch.allclose(joined.base, whole.base, atol=1e-6)
    assert list(joined.adapters) == list(whole.adapters) == ["a", "b"]
    for name in ("a", "b"):
        assert torch.equal(joined.images[name], whole.images[name])
        assert torch.allclose(joined.adapters[name], whole.adapters[name], atol=1e-6)
    with pytest.raises(ValueError, match="same adapter set"):
        FusedOutput.cat([whole, engine(x, engine.prepare_set([]))])


def mixed_tasks(engine):
    names = ["a", "b", "c", "d"]
    loaded = engine.prepare_set(
        [random_adapter(n, engine, m=i % 3, classes=2 + i) for i, n in enumerate(names)]
    )
    tasks = [["b", "d"], [], ["a"], ["a", "b", "c", "d"], ["c"], ["b"]]
    return loaded, tasks


def test_answers_cut_a_request_from_the_flat_logits_by_image_then_task(engine) -> None:
    loaded, tasks = mixed_tasks(engine)
    out = engine(images(engine, batch=6), loaded, tasks=tasks)
    for lo, hi in ((0, 6), (1, 4), (3, 4), (5, 6), (2, 2)):
        flat, answers = out.answers(lo, hi)
        expected = [(b - lo, n) for b in range(lo, hi) for n in sorted(tasks[b])]
        names = loaded.names
        assert [(int(i), names[t]) for i, t in zip(answers.image, answers.task, strict=True)] == expected
        for i, t, row, c in zip(answers.image, answers.task, answers.row, answers.classes, strict=True):
            name = names[t]
            who = out.images[name].tolist().index(lo + int(i))
            assert c == loaded[name].head_weight.shape[0]
            assert torch.equal(flat[row, :c], out.adapters[name][who])


def test_a_slice_of_a_routed_output_keeps_its_images_tasks_and_rows(engine) -> None:
    loaded, tasks = mixed_tasks(engine)
    out = engine(images(engine, batch=6), loaded, tasks=tasks)
    part = out[2:5]
    assert list(part.adapters) == ["a", "b", "c", "d"]
    assert part.images["a"].tolist() == [0, 1] and part.images["b"].tolist() == [1]
    for name in part.adapters:
        keep = [i for i, b in enumerate(out.images[name].tolist()) if 2 <= b < 5]
        assert torch.equal(part.adapters[name], out.adapters[name][keep])
    assert list(out[1:2].adapters) == [] and len(out[1:2]) == 1  # an image that asked for nothing
    # The same answers whether cut from the whole output or from the slice.
    whole, sliced = out.answers(2, 5), part.answers()
    assert np.array_equal(whole[1].task, sliced[1].task)
    assert torch.equal(whole[0][whole[1].row], sliced[0][sliced[1].row])


def test_moving_an_output_copies_two_tensors_whatever_the_number_of_tasks(engine) -> None:
    loaded = engine.prepare_set([random_adapter(f"a{i}", engine, classes=2 + i % 3) for i in range(12)])
    out = engine(images(engine, batch=3), loaded)
    copies = []
    real = torch.Tensor.to

    def counting(self, *args, **kwargs):
        copies.append(self.shape)
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "to", counting)
        moved = out.to("cpu", torch.float64)
    assert len(copies) == 4  # base and flat: cast, then copied
    assert len(moved.adapters) == 12 and moved.index is out.index


def test_a_task_index_asks_what_names_ask_and_remaps_to_a_newer_set(engine) -> None:
    loaded, tasks = mixed_tasks(engine)
    x = images(engine, batch=6)
    index = TaskIndex.join([TaskIndex.from_names(loaded, [t]) for t in tasks])
    by_names, by_index = engine(x, loaded, tasks=tasks), engine(x, loaded, tasks=index)
    assert list(by_names.adapters) == list(by_index.adapters)
    for name in by_names.adapters:
        assert torch.equal(by_names.adapters[name], by_index.adapters[name])
    newer = loaded.without("d").with_adapter(loaded["d"])  # d moves to the end
    moved = index.remap(newer)
    assert [moved.names(b) for b in range(6)] == [sorted(t) for t in tasks]
    gone = loaded.without("c")
    with pytest.raises(Exception, match="'c'"):
        index.remap(gone)
    uniform = TaskIndex.uniform(loaded, ["c", "a"], 3)
    assert [uniform.names(b) for b in range(3)] == [["a", "c"]] * 3


def test_a_routed_pass_answers_image_by_image_in_one_range_per_request(engine, monkeypatch) -> None:
    """Routed outputs lie in the batch's own order (image by image, tasks ascending): the plan sorts
    nothing before the launch, a request's answers are one range of rows, and a task's rows are
    found when read (a view when they are one run, else gathered)."""
    from memvit.memory_core.routing import planner

    loaded, tasks = mixed_tasks(engine)
    for sort in ("argsort", "lexsort", "sort"):
        monkeypatch.setattr(planner.np, sort, None, raising=False)  # any sort in the plan fails
    out = engine(images(engine, batch=6), loaded, tasks=tasks)
    monkeypatch.undo()
    flat, answers = out.answers()
    assert answers.row.tolist() == list(range(len(answers)))  # 2 + 0 + 1 + 4 + 1 + 1 answers
    assert out.answers(3, 5)[1].row.tolist() == [3, 4, 5, 6, 7]  # images 3 and 4: rows 3 to 7
    assert torch.equal(out.adapters["a"], flat[[2, 3], :2])  # images 2 and 3: one run, a view
    assert out.adapters["a"].data_ptr() == flat[2].data_ptr()
    assert torch.equal(out.adapters["b"], flat[[0, 4, 8], :3])  # images 0, 3, 5: gathered
    assert torch.equal(out.adapters["c"], flat[[5, 7], :4])
    assert out.images["b"].tolist() == [0, 3, 5] and out.images["c"].tolist() == [3, 4]
