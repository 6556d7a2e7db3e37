"""The live adapter set (memory_core/engine/live.py): atomic, validated changes under one lock, snapshots that
a change never touches, and adapters that must have been prepared for the engine's device and dtype."""

from __future__ import annotations

import threading

import pytest
import torch

from memvit.memory_core import (
    AdapterInUseError,
    AdapterSet,
    AdapterShapeError,
    AdapterWeights,
    DuplicateAdapterError,
    LiveAdapters,
    MissingParentError,
    UnknownAdapterError,
)
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine


@pytest.fixture
def live(engine) -> LiveAdapters:
    return LiveAdapters(engine)


def test_starts_empty_and_the_engine_knows_nothing_of_it(live) -> None:
    assert len(live.current) == 0 and live.current.stack is None
    assert not hasattr(live.engine, "adapters") and not hasattr(live.engine, "install")


def test_add_replace_remove(live) -> None:
    engine = live.engine
    a = random_adapter("a", engine)
    s1 = live.add(a)
    with pytest.raises(DuplicateAdapterError, match="already loaded"):
        live.add(random_adapter("a", engine, seed=1))
    assert live.current is s1
    s2 = live.add(random_adapter("a", engine, seed=1, m=4), replace=True)
    assert s2.names == ("a",) and s2["a"].weights.num_memory == 4
    assert s1["a"].weights is a  # the old snapshot is untouched
    s3 = live.remove("a")
    assert len(s3) == 0 and live.current.stack is None
    with pytest.raises(UnknownAdapterError, match="no adapter named 'a'"):
        live.remove("a")
    assert len({s1.version, s2.version, s3.version}) == 3


def test_replace_keeps_position(live) -> None:
    live.replace_all([random_adapter(n, live.engine) for n in "abc"])
    live.add(random_adapter("b", live.engine, seed=5), replace=True)
    assert live.current.names == ("a", "b", "c")


def test_extension_needs_its_parent_and_protects_it(live) -> None:
    engine = live.engine
    before = live.current
    with pytest.raises(MissingParentError, match="extends 'p'"):
        live.add(random_adapter("c", engine, parent="p"))
    assert live.current is before
    live.add(random_adapter("p", engine))
    live.add(random_adapter("c", engine, parent="p"))
    live.add(random_adapter("g", engine, parent="c"))
    assert live.current.lineage("g") == ["g", "c", "p"]
    current = live.current
    with pytest.raises(AdapterInUseError, match="extend it"):
        live.remove("p")
    with pytest.raises(AdapterInUseError, match="extend it"):
        live.add(random_adapter("p", engine, seed=3), replace=True)
    assert live.current is current
    live.remove("g")
    live.remove("c")
    live.remove("p")
    assert len(live.current) == 0


def test_replace_all_is_all_or_nothing(live) -> None:
    engine = live.engine
    live.replace_all([random_adapter("keep", engine)])
    current = live.current
    with pytest.raises(MissingParentError):
        live.replace_all([random_adapter("x", engine), random_adapter("y", engine, parent="nope")])
    with pytest.raises(DuplicateAdapterError):
        live.replace_all([random_adapter("x", engine), random_adapter("x", engine)])
    assert live.current is current


def test_shape_checks_before_anything_is_copied(live) -> None:
    spec = live.engine.spec
    current = live.current
    wrong_depth = AdapterWeights(
        "d",
        torch.zeros(spec.depth + 1, 1, spec.width),
        torch.zeros(spec.width),
        torch.zeros(2, spec.width),
        torch.zeros(2),
    )
    with pytest.raises(AdapterShapeError, match="memory for 4 layers, vit_tiny_patch16_224 has 3"):
        live.add(wrong_depth)
    wrong_width = AdapterWeights(
        "w", torch.zeros(spec.depth, 1, 8), torch.zeros(8), torch.zeros(2, 8), torch.zeros(2)
    )
    with pytest.raises(AdapterShapeError, match="width 8"):
        live.add(wrong_width)
    assert live.current is current


def test_a_pass_keeps_the_snapshot_it_started_with(live) -> None:
    engine = live.engine
    x = images(engine)
    first = live.add(random_adapter("a", engine))
    held = live.current  # what a pass reads once, at its start
    live.add(random_adapter("b", engine))  # installed while that pass "runs"
    old = engine(x, held)
    assert list(old.adapters) == ["a"] and old.adapter_set is first
    new = engine(x, live.current)
    assert list(new.adapters) == ["a", "b"]
    assert new.adapter_set.version > first.version
    assert max_diff(old.adapters["a"], new.adapters["a"]) <= TOL


def test_install_is_the_one_swap_and_exclusive_orders_writers(live) -> None:
    """Writers read, derive, persist and install under one lock; a failure before install changes nothing."""
    engine = live.engine
    first = live.install(AdapterSet((engine.prepare(random_adapter("a", engine)),)))
    assert live.current is first
    with pytest.raises(OSError, match="disk full"), live.exclusive() as current:
        new = current.with_adapter(engine.prepare(random_adapter("b", engine)))
        raise OSError("disk full")  # e.g. the store write failed: install never runs
        live.install(new)
    assert live.current is first
    # While one writer holds the lock, another's add waits for it and then sees its result.
    order = []
    with live.exclusive() as current:
        other = threading.Thread(target=lambda: order.append(live.add(random_adapter("c", engine))))
        other.start()
        other.join(timeout=0.3)
        assert other.is_alive() and live.current is current  # blocked on the lock
        with live.exclusive():  # re-entrant
            live.install(current.with_adapter(engine.prepare(random_adapter("b", engine))))
    other.join(timeout=10)
    assert live.current.names == ("a", "b", "c") and order[0] is live.current


def test_install_refuses_adapters_prepared_elsewhere(live) -> None:
    other = tiny_engine().to(torch.float64)
    foreign = other.prepare_set([random_adapter("a", other)])
    with pytest.raises(
        AdapterShapeError, match=r"'a' was prepared for cpu/torch.float64, not cpu/torch.float32"
    ):
        live.install(foreign)
    assert len(live.current) == 0


def test_move_to_moves_the_engine_and_re_prepares_the_live_set(live) -> None:
    engine = live.engine
    live.replace_all([random_adapter("a", engine, m=2), random_adapter("b", engine, m=0)])
    x = images(engine)
    before = engine(x, live.current)
    version = live.current.version
    moved = live.move_to(dtype=torch.float64)
    assert engine.dtype == torch.float64 and live.current is moved
    assert moved.version == version and moved.names == ("a", "b")  # the same adapters
    assert moved.stack.layers[0].keys.dtype == torch.float64
    after = engine(x.double(), moved)
    for name in ("a", "b"):
        assert max_diff(after.adapters[name], before.adapters[name]) <= 1e-5
    live.add(random_adapter("c", engine))  # prepared for the new dtype: accepted


def test_a_bare_move_leaves_the_base_working_and_stale_adapters_refused(live) -> None:
    """``engine.to()`` moves the base only; the old set cannot be run, installed or added to silently."""
    engine = live.engine
    live.replace_all([random_adapter("a", engine)])
    stale = live.current
    x = images(engine)
    expected = engine(x).base
    assert engine.dtype == torch.float32  # read (and kept) before the move
    engine.to(torch.float64)
    assert engine.dtype == torch.float64 and engine.device.type == "cpu"  # forgotten by the move
    assert max_diff(engine(x.double()).base, expected) <= 1e-5  # the base alone still runs
    assert max_diff(engine.base(x.double()), expected) <= 1e-5
    with pytest.raises(
        AdapterShapeError, match=r"'a' was prepared for cpu/torch.float32, not cpu/torch.float64"
    ):
        engine(x.double(), stale)
    with pytest.raises(AdapterShapeError, match=r"prepared for cpu/torch.float32"):
        engine(x.double(), stale, tasks=[["a"], [], []])
    with pytest.raises(AdapterShapeError, match=r"LiveAdapters.move_to"):
        live.install(stale.at_version(99))
    with pytest.raises(AdapterShapeError, match=r"'a' was prepared for cpu/torch.float32"):
        live.add(random_adapter("b", engine))  # the new set would still hold the stale 'a'
    assert live.current is stale
    live.move_to()  # to where the engine already is: re-prepares what was left behind
    assert live.current.stack.cls.dtype == torch.float64
    live.add(random_adapter("b", engine))
