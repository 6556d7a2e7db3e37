"""The /classify pipeline's own rules, without HTTP: task parsing and checks, and no null numbers."""

from __future__ import annotations

import pytest
import torch

from memory_core import AdapterSet, FusedOutput, LiveAdapters
from server.errors import NonFiniteOutputError, UnknownTaskError
from server.pipeline import ClassifyPipeline, check_tasks, parse_tasks
from tests.conftest import random_adapter, tiny_engine


def _pipeline(engine) -> ClassifyPipeline:
    live = LiveAdapters(engine)
    return ClassifyPipeline(live, None, None, None, max_images=4, max_image_bytes=1000)  # type: ignore[arg-type]


def test_parse_and_check_tasks() -> None:
    assert parse_tasks(None) is None and parse_tasks([" ", ""]) is None
    assert parse_tasks(["a,b", " c "]) == ["a", "b", "c"]
    engine = tiny_engine()
    live = AdapterSet((engine.prepare(random_adapter("a", engine)),))
    check_tasks(["base", "a"], live)
    with pytest.raises(UnknownTaskError, match=r"unknown task\(s\) \['gone'\]"):
        check_tasks(["a", "gone"], live)


def test_response_is_built_from_one_output_and_never_holds_null() -> None:
    engine = tiny_engine()
    out = engine(torch.randn(2, 3, 32, 32), engine.prepare_set([random_adapter("a", engine, classes=3)]))
    response = _pipeline(engine).respond(out[1:2], ["x"], ["a"], top_k=2, logits=True)
    task = response.results[0].tasks["a"]
    assert list(response.results[0].tasks) == ["a"] and len(task.predictions) == 2
    assert task.logits == pytest.approx(out.adapters["a"][1].tolist())
    broken = FusedOutput.every_image(out.base, {"a": torch.full((2, 3), float("inf"))}, out.adapter_set)
    with pytest.raises(NonFiniteOutputError, match="non-finite logits"):
        _pipeline(engine).respond(broken, ["x", "y"], None, top_k=1, logits=False)
