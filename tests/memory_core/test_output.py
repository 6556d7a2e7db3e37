"""FusedOutput (memory_core/output.py): one shape for routed and unrouted passes, sliced per request."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import FusedOutput
from tests.conftest import images, random_adapter


def test_unrouted_every_task_answers_every_image_and_slices_as_views(engine) -> None:
    loaded = engine.prepare_set([random_adapter("a", engine, classes=3), random_adapter("b", engine, m=0)])
    x = images(engine, batch=5)
    out = engine(x, loaded)
    assert list(out.images) == ["a", "b"] and out.images["a"].tolist() == [0, 1, 2, 3, 4]
    assert out.images["a"] is out.images["b"]  # one shared index tensor
    part = out[1:4]
    assert len(part) == 3 and part.adapter_set is loaded
    assert torch.equal(part.base, out.base[1:4])
    for name in ("a", "b"):
        assert torch.equal(part.adapters[name], out.adapters[name][1:4])
        assert part.images[name].tolist() == [0, 1, 2]
        assert part.adapters[name].data_ptr() == out.adapters[name][1:4].data_ptr()  # a view, no copy
    moved = out.to("cpu", torch.float64)
    assert moved.adapters["a"].dtype == torch.float64 and moved.images["a"] is moved.images["b"]
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
