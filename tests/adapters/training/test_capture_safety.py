"""What keeps a run's CUDA graph captures valid, checked on the CPU: no loader of a run pins batches
on a thread of its own (a pin-memory thread's ``cudaHostAlloc`` invalidates a capture in CUDA's
global mode, the inference engine's, which float32 evaluation replays: the regime's float32 run
failed so on an H200), and a failed capture is told apart from a broken device.
tests/adapters/training/test_cuda.py runs the regime's path on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainConfig, scan_folder
from memvit.adapters.training.base_pass import after_failed_capture
from memvit.adapters.training.batches import batches
from memvit.adapters.training.metrics import _batches
from memvit.memory_core import MemoryViT
from tests.conftest import tiny_engine


class _Made(Exception):
    """Raised by the spy once a loader is made: nothing is loaded (there is no CUDA to pin for)."""


@pytest.fixture
def loaders_for_cuda(monkeypatch) -> list[dict]:
    """The keyword arguments of every DataLoader made, with the engine on a (pretended) CUDA device."""
    made: list[dict] = []

    def spy(self, *args, **kwargs) -> None:
        made.append(kwargs)
        raise _Made

    monkeypatch.setattr(DataLoader, "__init__", spy)
    monkeypatch.setattr(MemoryViT, "device", property(lambda self: torch.device("cuda", 0)))
    return made


def test_no_loader_of_a_run_pins_on_a_thread_of_its_own(loaders_for_cuda, image_folder) -> None:
    engine = tiny_engine()
    samples = scan_folder(image_folder)
    config = TrainConfig(name="a", train_dir=str(image_folder), steps=4, batch_size=4)
    with pytest.raises(_Made):  # the training batches (a run's Feed pins them: batches.py)
        batches(engine, config, samples, None, total=4, start=0, workers=2)
    with pytest.raises(_Made):  # evaluation's, in float32 (the engine's graphs) and bfloat16
        next(_batches(samples, eval_transform(engine), 8, 2, engine=engine))
    with pytest.raises(_Made):
        next(_batches(samples, eval_transform(engine), 8, 2, engine=engine, precision="bfloat16"))
    assert len(loaders_for_cuda) == 3
    assert [kw.get("pin_memory", False) for kw in loaders_for_cuda] == [False] * 3
    assert [kw["num_workers"] for kw in loaders_for_cuda] == [2] * 3  # still decoded beside the step


def test_a_failed_capture_then_a_failing_device_raises_both(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    after_failed_capture(torch.device("cuda", 0), "AcceleratorError: capture invalidated")
    assert calls == [torch.device("cuda", 0)]  # a failed capture alone: waited for, then eager

    def broken(device=None) -> None:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with pytest.raises(RuntimeError, match=r"capture failed .*invalidated.*then the device.*illegal"):
        after_failed_capture(torch.device("cuda", 0), "AcceleratorError: capture invalidated")
    # What the trainer's captures catch (``except RuntimeError``) covers torch's accelerator errors.
    assert issubclass(torch.AcceleratorError, RuntimeError)
