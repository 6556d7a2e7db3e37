"""The live adapter set: atomic, validated changes that leave the old snapshot untouched."""

from __future__ import annotations

import pytest
import torch

from memory_core import (
    AdapterInUseError,
    AdapterSet,
    AdapterShapeError,
    AdapterWeights,
    DuplicateAdapterError,
    MissingParentError,
    UnknownAdapterError,
)
from tests.conftest import images, max_diff, random_adapter, tiny_engine


def test_add_replace_remove(engine) -> None:
    a = random_adapter("a", engine)
    s1 = engine.add_adapter(a)
    with pytest.raises(DuplicateAdapterError, match="already loaded"):
        engine.add_adapter(random_adapter("a", engine, seed=1))
    assert engine.adapters is s1
    s2 = engine.add_adapter(random_adapter("a", engine, seed=1, m=4), replace=True)
    assert s2.names == ("a",) and s2["a"].weights.num_memory == 4
    assert s1["a"].weights is a  # the old snapshot is untouched
    s3 = engine.remove_adapter("a")
    assert len(s3) == 0 and engine.adapters.stack is None
    with pytest.raises(UnknownAdapterError, match="no adapter named 'a'"):
        engine.remove_adapter("a")
    assert len({s1.version, s2.version, s3.version}) == 3


def test_replace_keeps_position(engine) -> None:
    engine.set_adapters([random_adapter(n, engine) for n in "abc"])
    engine.add_adapter(random_adapter("b", engine, seed=5), replace=True)
    assert engine.adapters.names == ("a", "b", "c")


def test_extension_needs_its_parent_and_protects_it(engine) -> None:
    before = engine.adapters
    with pytest.raises(MissingParentError, match="extends 'p'"):
        engine.add_adapter(random_adapter("c", engine, parent="p"))
    assert engine.adapters is before
    engine.add_adapter(random_adapter("p", engine))
    engine.add_adapter(random_adapter("c", engine, parent="p"))
    engine.add_adapter(random_adapter("g", engine, parent="c"))
    assert engine.adapters.lineage("g") == ["g", "c", "p"]
    live = engine.adapters
    with pytest.raises(AdapterInUseError, match="extend it"):
        engine.remove_adapter("p")
    with pytest.raises(AdapterInUseError, match="extend it"):
        engine.add_adapter(random_adapter("p", engine, seed=3), replace=True)
    assert engine.adapters is live
    engine.remove_adapter("g")
    engine.remove_adapter("c")
    engine.remove_adapter("p")
    assert len(engine.adapters) == 0


def test_set_adapters_is_all_or_nothing(engine) -> None:
    engine.set_adapters([random_adapter("keep", engine)])
    live = engine.adapters
    with pytest.raises(MissingParentError):
        engine.set_adapters([random_adapter("x", engine), random_adapter("y", engine, parent="nope")])
    with pytest.raises(DuplicateAdapterError):
        engine.set_adapters([random_adapter("x", engine), random_adapter("x", engine)])
    assert engine.adapters is live


def test_shape_checks_before_anything_is_copied(engine) -> None:
    spec = engine.spec
    live = engine.adapters
    wrong_depth = AdapterWeights(
        "d",
        torch.zeros(spec.depth + 1, 1, spec.width),
        torch.zeros(spec.width),
        torch.zeros(2, spec.width),
        torch.zeros(2),
    )
    with pytest.raises(AdapterShapeError, match="memory for 4 layers, vit_tiny_patch16_224 has 3"):
        engine.add_adapter(wrong_depth)
    wrong_width = AdapterWeights(
        "w", torch.zeros(spec.depth, 1, 8), torch.zeros(8), torch.zeros(2, 8), torch.zeros(2)
    )
    with pytest.raises(AdapterShapeError, match="width 8"):
        engine.add_adapter(wrong_width)
    assert engine.adapters is live


def test_moving_the_engine_re_prepares_adapters() -> None:
    engine = tiny_engine()
    engine.set_adapters([random_adapter("a", engine, m=2)])
    x = images(engine)
    before = engine(x).adapters["a"]
    engine.to(torch.float64)
    assert engine.adapters.stack.layers[0].keys.dtype == torch.float64
    assert max_diff(engine(x.double()).adapters["a"], before) <= 1e-5


def test_install_is_the_one_swap_and_exclusive_orders_writers(engine) -> None:
    """Writers read, derive, persist and install under one lock; a failure before install changes nothing."""
    import threading

    first = engine.install(AdapterSet((engine.prepare(random_adapter("a", engine)),)))
    assert engine.adapters is first
    with pytest.raises(OSError, match="disk full"), engine.exclusive() as live:
        new = live.with_adapter(engine.prepare(random_adapter("b", engine)))
        raise OSError("disk full")  # e.g. the store write failed: install never runs
        engine.install(new)
    assert engine.adapters is first
    # While one writer holds the lock, another's add waits for it and then sees its result.
    order = []
    with engine.exclusive() as live:
        other = threading.Thread(target=lambda: order.append(engine.add_adapter(random_adapter("c", engine))))
        other.start()
        other.join(timeout=0.3)
        assert other.is_alive() and engine.adapters is live  # blocked on the lock
        engine.install(live.with_adapter(engine.prepare(random_adapter("b", engine))))
    other.join(timeout=10)
    assert engine.adapters.names == ("a", "b", "c") and order[0] is engine.adapters


def test_install_refuses_adapters_prepared_elsewhere(engine) -> None:
    other = tiny_engine()
    other.to(torch.float64)
    foreign = AdapterSet((other.prepare(random_adapter("a", other)),))
    with pytest.raises(AdapterShapeError, match="prepare it with this engine"):
        engine.install(foreign)
    assert len(engine.adapters) == 0


def test_all_tasks_stack_applies_heads_per_class_count(engine) -> None:
    # Interleaved class counts: the groups must scatter each adapter's logits back to its own slot.
    classes = [3, 5, 3, 7, 5, 3]
    engine.set_adapters([random_adapter(f"h{i}", engine, classes=c) for i, c in enumerate(classes)])
    stack = engine.adapters.stack
    assert sorted(g.weight.shape[1] for g in stack.head_groups) == [3, 5, 7]
    assert sorted(k for g in stack.head_groups for k in g.members.tolist()) == list(range(len(classes)))
    c = torch.randn(4, len(classes), engine.spec.width)
    batched = stack.apply_heads(c)
    for k, (weight, bias) in enumerate(stack.heads):
        assert batched[k].shape == (4, classes[k])
        assert max_diff(batched[k], torch.nn.functional.linear(c[:, k], weight, bias)) <= 1e-5
