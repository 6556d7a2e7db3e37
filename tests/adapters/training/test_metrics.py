"""memvit eval's core: accuracy through one fused engine, and the alone-vs-fused check."""

from __future__ import annotations

import pytest

from memvit.adapters.training import DataError, evaluate_tasks, train_adapter
from memvit.adapters.training.config import TrainConfig
from memvit.memory_core import LiveAdapters, MemoryViT
from tests.conftest import COLOURS, make_folder, random_adapter


def test_fused_accuracy_equals_alone_with_many_adapters(tmp_path, image_folder, tiny_weights) -> None:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    result = train_adapter(
        engine,
        TrainConfig(
            name="colours", train_dir=str(image_folder), steps=20, batch_size=8, lr=0.1, memory_tokens=2
        ),
        progress=False,
    )
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"noise{i}", engine, m=i) for i in range(5)])
    live.add(result.bundle.weights)
    live.add(random_adapter("child", engine, m=1, parent="noise3", classes=3))
    live.remove("child")
    val = make_folder(tmp_path / "val", per_class=6, seed=7)
    (report,) = evaluate_tasks(live, {"colours": val}, batch_size=5)
    assert report.fused.images == 18
    assert report.unchanged and report.same_predictions
    assert report.max_logit_diff <= 1e-5
    assert report.fused.top1 == report.alone.top1 > 1 / 3


def test_base_task_labels_match_folder_names(tmp_path, tiny_weights) -> None:
    labels = ("blue sky", "green grass", "red wine", "x", "y", "z", "w")
    engine = MemoryViT.from_timm(weights=str(tiny_weights), labels=labels)
    val = make_folder(tmp_path / "val", per_class=2)
    (report,) = evaluate_tasks(LiveAdapters(engine), {"base": val})
    assert report.task == "base" and report.alone is None and report.fused.images == 2 * len(COLOURS)


def test_folder_classes_must_match_task_labels(tmp_path, tiny_weights) -> None:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))  # labels class_0..class_6
    val = make_folder(tmp_path / "val", per_class=2)
    with pytest.raises(DataError, match="folder class 'blue' matches 0 of the task's labels"):
        evaluate_tasks(LiveAdapters(engine), {"base": val})
