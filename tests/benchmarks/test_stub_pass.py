"""The benchmarks' stubbed pass (benchmarks/stub_pass.py) answers in the real pass's form: the same
tasks, images and shapes, a flat output with its index (what the server cuts answers from), zeros
for logits. Otherwise the front end's CPU figures would measure work a real pass never causes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import stub_pass
from memvit.memory_core import MemoryViT
from tests.conftest import images, random_adapter, tiny_engine


def _form(out) -> tuple:
    return (
        tuple(out.base.shape),
        {name: (tuple(t.shape), out.images[name].tolist()) for name, t in out.adapters.items()},
        out.flat is not None and out.index is not None,
    )


@pytest.mark.parametrize(
    "tasks",
    [None, [["a", "b", "c"]] * 3, [["a"], [], ["c", "b"]], [[], [], []]],
    ids=["all-tasks", "shared", "routed", "base-only"],
)
def test_the_stub_answers_in_the_real_pass_form(tasks, monkeypatch) -> None:
    engine = tiny_engine()
    adapters = [
        random_adapter(n, engine, m=m, classes=c) for n, m, c in [("a", 1, 3), ("b", 2, 7), ("c", 0, 2)]
    ]
    loaded, x = engine.prepare_set(adapters), images(engine, batch=3)
    with torch.inference_mode():
        real = engine(x, loaded, tasks=tasks)
        monkeypatch.setattr(MemoryViT, "_device_pass", stub_pass.stubbed_device_pass)
        stub = engine(x, loaded, tasks=tasks)
    assert _form(stub) == _form(real)
    assert not stub.base.any() and all(not t.any() for t in stub.adapters.values())
