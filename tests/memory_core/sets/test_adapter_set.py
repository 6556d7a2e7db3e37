"""Adapter sets: immutable snapshots, derived without touching the old one, stacked for the fused pass."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import (
    AdapterInUseError,
    AdapterSet,
    AdapterShapeError,
    DuplicateAdapterError,
    MissingParentError,
    UnknownAdapterError,
)
from tests.conftest import max_diff, random_adapter, tiny_engine


def test_deriving_sets_leaves_the_old_one_untouched(engine) -> None:
    a, b = (engine.prepare(random_adapter(n, engine)) for n in "ab")
    first = AdapterSet((a,))
    second = first.with_adapter(b)
    assert first.names == ("a",) and second.names == ("a", "b")
    assert second.without("a").names == ("b",) and second.names == ("a", "b")
    assert len({first.version, second.version}) == 2
    with pytest.raises(DuplicateAdapterError, match="already loaded"):
        second.with_adapter(a)
    with pytest.raises(UnknownAdapterError, match="no adapter named 'c'"):
        second.without("c")
    with pytest.raises(MissingParentError, match="extends 'p'"):
        AdapterSet((engine.prepare(random_adapter("c", engine, parent="p")),))
    child = engine.prepare(random_adapter("c", engine, parent="a"))
    with pytest.raises(AdapterInUseError, match="extend it"):
        second.with_adapter(child).without("a")


def test_a_stack_refuses_adapters_prepared_for_different_dtypes(engine) -> None:
    # torch would promote the mix silently while stacking; a set must be prepared by one engine.
    other = tiny_engine().to(torch.float64)
    mixed = AdapterSet(
        (engine.prepare(random_adapter("a", engine)), other.prepare(random_adapter("b", other)))
    )
    with pytest.raises(
        AdapterShapeError, match=r"'b' was prepared for cpu/torch.float64, not cpu/torch.float32"
    ):
        mixed.stack  # noqa: B018


def test_all_tasks_stack_applies_heads_per_class_count(engine) -> None:
    # Interleaved class counts: the groups must scatter each adapter's logits back to its own slot.
    classes = [3, 5, 3, 7, 5, 3]
    stack = engine.prepare_set(
        [random_adapter(f"h{i}", engine, classes=c) for i, c in enumerate(classes)]
    ).stack
    assert sorted(g.weight.shape[1] for g in stack.head_groups) == [3, 5, 7]
    assert sorted(k for g in stack.head_groups for k in g.members.tolist()) == list(range(len(classes)))
    c = torch.randn(4, len(classes), engine.spec.width)
    batched = stack.apply_heads(c)
    for k, (weight, bias) in enumerate(stack.heads):
        assert batched[k].shape == (4, classes[k])
        assert max_diff(batched[k], torch.nn.functional.linear(c[:, k], weight, bias)) <= 1e-5
