"""Per-image task routing: a routed pass answers exactly what each image asked, with the logits the
all-tasks pass and the dense reference give (memory_core/routing/plan.py)."""

from __future__ import annotations

import random

import pytest
import torch

from memvit.memory_core import InputError, LiveAdapters, UnknownAdapterError
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.conftest import TOL, images, max_diff, random_adapter, tiny_engine


def mixed_engine(variant: str = "qknorm_layerscale_prenorm"):
    engine = tiny_engine(variant)
    adapters = [
        random_adapter("m0", engine, m=0),
        random_adapter("m1", engine, m=1, memory_norm="none", classes=3),
        random_adapter("m5", engine, m=5, classes=11),
        random_adapter("m2", engine, m=2, classes=2),
        random_adapter("m3", engine, m=3, memory_norm="none", classes=7),
    ]
    return engine, engine.prepare_set(adapters), adapters


def check_routed(engine, loaded, x, tasks, path="merged") -> None:
    """Every (image, task) asked equals the all-tasks pass; nothing else is answered."""
    full = engine(x, loaded, path=path)
    routed = engine(x, loaded, tasks=tasks, path=path)
    assert max_diff(routed.base, full.base) <= TOL
    for name, logits in routed.adapters.items():
        who = routed.images[name].tolist()
        assert who == [b for b, asked in enumerate(tasks) if name in asked]
        assert max_diff(logits, full.adapters[name][who]) <= TOL
        assert torch.equal(logits.argmax(-1), full.adapters[name][who].argmax(-1))
    assert set(routed.adapters) == {name for asked in tasks for name in asked}


@pytest.mark.parametrize("path", ["merged", "split"])
def test_mixed_filters_in_one_batch_equal_the_all_tasks_pass(path: str) -> None:
    engine, loaded, adapters = mixed_engine()
    x = images(engine, batch=6)
    rng = random.Random(0)
    names = [a.name for a in adapters]
    tasks = [rng.sample(names, k) for k in (1, 0, 5, 2, 1, 3)]  # one image asks for nothing
    check_routed(engine, loaded, x, tasks, path)
    # And against the independent dense reference.
    routed = engine(x, loaded, tasks=tasks, path=path)
    _, ref = DenseMemoryViT(engine.base, adapters)(x)
    for name, logits in routed.adapters.items():
        assert max_diff(logits, ref[name][routed.images[name]]) <= TOL


def test_an_adapter_asked_by_one_image_only() -> None:
    engine, loaded, _ = mixed_engine()
    x = images(engine, batch=4)
    tasks = [[], ["m5"], [], []]
    out = engine(x, loaded, tasks=tasks)
    assert list(out.adapters) == ["m5"] and out.images["m5"].tolist() == [1]
    assert out.adapters["m5"].shape == (1, 11)
    check_routed(engine, loaded, x, tasks)


@pytest.mark.parametrize("path", ["merged", "split"])
def test_extension_chains_bring_their_ancestors_but_return_only_what_was_asked(path: str) -> None:
    engine = tiny_engine()
    chain = [
        random_adapter("root", engine, m=2),
        random_adapter("child", engine, m=1, parent="root", memory_norm="none"),
        random_adapter("grandchild", engine, m=3, parent="child"),
        random_adapter("sibling", engine, m=4, parent="root"),
        random_adapter("loner", engine, m=0),
    ]
    loaded = engine.prepare_set(chain)
    x = images(engine, batch=4)
    tasks = [["grandchild"], ["sibling", "loner"], ["root"], ["child", "grandchild"]]
    out = engine(x, loaded, tasks=tasks, path=path)
    assert set(out.adapters) == {"grandchild", "sibling", "loner", "root", "child"}
    assert out.images["root"].tolist() == [2]  # computed for images 0, 1 and 3 too, returned for 2 only
    check_routed(engine, loaded, x, tasks, path)
    _, ref = DenseMemoryViT(engine.base, chain)(x)
    for name, logits in out.adapters.items():
        assert max_diff(logits, ref[name][out.images[name]]) <= TOL


def test_nobody_asking_is_a_base_only_pass_equal_to_timm() -> None:
    engine, loaded, _ = mixed_engine()
    x = images(engine, batch=3)
    out = engine(x, loaded, tasks=[[], [], []])
    assert out.adapters == {} and out.images == {}
    assert max_diff(out.base, engine.base(x)) <= TOL  # the base is timm's own model


def test_no_adapters_loaded() -> None:
    engine = tiny_engine()
    x = images(engine, batch=2)
    out = engine(x, tasks=[[], []])  # no set: the base alone
    assert out.adapters == {} and max_diff(out.base, engine(x).base) <= TOL
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine(x, tasks=[["nope"], []])
    with pytest.raises(UnknownAdapterError, match="nope"):
        engine(x, LiveAdapters(engine).current, tasks=[["nope"], []])


def test_bad_task_lists_are_refused() -> None:
    engine, loaded, _ = mixed_engine()
    x = images(engine, batch=2)
    with pytest.raises(UnknownAdapterError, match="gone"):
        engine(x, loaded, tasks=[["m1"], ["gone"]])
    with pytest.raises(InputError, match="one collection per image"):
        engine(x, loaded, tasks=[["m1"]])
    with pytest.raises(InputError, match="not a string"):
        engine(x, loaded, tasks=["m1", "m2"])


def test_a_removed_adapter_in_a_snapshot_is_still_answered_by_that_snapshot() -> None:
    engine, loaded, _ = mixed_engine()
    live = LiveAdapters(engine)
    snapshot = live.install(loaded)
    live.remove("m2")
    x = images(engine, batch=2)
    out = engine(x, snapshot, tasks=[["m2"], []])  # the snapshot still has it
    assert out.images["m2"].tolist() == [0]
    with pytest.raises(UnknownAdapterError):
        engine(x, live.current, tasks=[["m2"], []])  # the live set does not


def test_routed_output_slices_per_request() -> None:
    engine, loaded, _ = mixed_engine()
    x = images(engine, batch=5)
    tasks = [["m1"], ["m1", "m5"], [], ["m5"], ["m1"]]
    out = engine(x, loaded, tasks=tasks)
    first, second = out[0:2], out[2:5]
    assert first.images["m1"].tolist() == [0, 1] and first.images["m5"].tolist() == [1]
    assert second.images["m1"].tolist() == [2] and second.images["m5"].tolist() == [1]
    assert max_diff(second.adapters["m5"], out.adapters["m5"][1:]) == 0.0
    assert len(second) == 3 and second.to().images["m5"].tolist() == [1]
    assert out[2:3].adapters == {} and out[2:3].images == {}  # image 2 asked for nothing


def test_no_pass_stacks_and_slots_are_written_once() -> None:
    """Add/remove build a new set without stacking; no inference pass stacks either. Installing gives
    each new adapter its device slot; a pass over a set never installed gives slots to the adapters
    its batch needs only, once."""
    from memvit.memory_core.sets import stack as adapter_set_module

    engine = tiny_engine()
    live = LiveAdapters(engine)
    live.replace_all([random_adapter(f"a{i}", engine, m=i % 3) for i in range(40)])
    stacked: list[int] = []
    real = adapter_set_module._build_stack

    def counting(adapters, lineages):
        stacked.append(len(adapters))
        return real(adapters, lineages)

    adapter_set_module._build_stack = counting
    try:
        assert engine.slots.writes == 40
        live.add(random_adapter("new", engine, m=2))
        live.remove("a3")
        assert engine.slots.writes == 41  # the one new adapter
        x = images(engine, batch=2)
        engine(x, live.current, tasks=[["new"], ["a1", "a2"]])
        engine(x, live.current)
        assert engine.slots.writes == 41  # passes find every live adapter in its slot
        apart = engine.prepare_set([random_adapter(f"b{i}", engine) for i in range(10)])  # not installed
        engine(x, apart, tasks=[["b1"], ["b2", "b3"]])
        assert engine.slots.writes == 44  # only the three adapters asked for
        engine(x, apart)
        engine(x, apart)
        assert engine.slots.writes == 51  # the other seven, once
        assert stacked == []  # nothing was stacked, by a change or by a pass
    finally:
        adapter_set_module._build_stack = real
