"""The /classify pipeline's own rules, without HTTP: the response from one output, no null numbers."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import FusedOutput, LiveAdapters
from memvit.server.errors import NonFiniteOutputError
from memvit.server.pipeline import ClassifyPipeline
from memvit.server.registry import AdapterRegistry
from memvit.server.store import LocalStore
from tests.conftest import random_adapter, tiny_engine


def _pipeline(engine, tmp_path) -> ClassifyPipeline:
    registry = AdapterRegistry(LiveAdapters(engine), LocalStore(tmp_path), max_bundle_bytes=1000)
    return ClassifyPipeline(registry, None, None, None, max_image_bytes=1000)  # type: ignore[arg-type]


def test_response_is_built_from_one_output_and_never_holds_null(tmp_path) -> None:
    engine = tiny_engine()
    out = engine(torch.randn(2, 3, 32, 32), engine.prepare_set([random_adapter("a", engine, classes=3)]))
    response = _pipeline(engine, tmp_path).respond(out[1:2], ["x"], ["a"], top_k=2, logits=True)
    task = response.results[0].tasks["a"]
    assert list(response.results[0].tasks) == ["a"] and len(task.predictions) == 2
    assert response.tasks == ["a"]
    assert task.logits == pytest.approx(out.adapters["a"][1].tolist())
    broken = FusedOutput.every_image(out.base, {"a": torch.full((2, 3), float("inf"))}, out.adapter_set)
    with pytest.raises(NonFiniteOutputError, match="non-finite logits"):
        _pipeline(engine, tmp_path).respond(broken, ["x", "y"], None, top_k=1, logits=False)
