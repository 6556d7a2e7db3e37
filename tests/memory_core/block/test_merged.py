"""The merged block's two routes for the class-token rows' attention: on the CPU, the base's own
attention kernel over every row with its log-sum-exp (``summary_attention``); elsewhere, or without fused
attention, the base keys and values read directly (``KeysValues``). Both against the dense oracle."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core.block import merged
from memvit.memory_core.oracle.reference import DenseMemoryViT
from tests.conftest import TOL, assert_tasks_match, images, max_diff, random_adapter, tiny_engine


def _adapters(engine):
    return [
        random_adapter("m0", engine, m=0),
        random_adapter("m1", engine, m=1, memory_norm="none"),
        random_adapter("m5", engine, m=5, classes=11),
        random_adapter("child", engine, m=2, parent="m1"),  # extension mode: lineage of 2
    ]


def _every_and_routed_match_the_oracle(engine, x, adapters) -> None:
    """An all-tasks pass and a routed one (the first pass over 4 rows, the second over 3), each
    against the dense oracle."""
    loaded = engine.prepare_set(adapters)
    tasks = [["m0", "child"], ["m5"], [], ["m1", "m0", "m5"]]
    with torch.no_grad():
        every = engine(x, loaded)
        routed = engine(x, loaded, tasks=tasks)
    base_ref, adapter_ref = DenseMemoryViT(engine.base, adapters)(x)
    assert max_diff(every.base, base_ref) <= TOL and max_diff(routed.base, base_ref) <= TOL
    assert_tasks_match(every, routed, tasks, adapter_ref)


@pytest.mark.parametrize("summarised", [True, False])
@pytest.mark.parametrize("variant", ["plain", "registers", "qknorm_layerscale_prenorm"])
def test_both_routes_equal_the_dense_oracle(variant: str, summarised: bool, monkeypatch) -> None:
    engine = tiny_engine(variant)
    adapters = _adapters(engine)
    x = images(engine, batch=4)
    calls = []
    route = merged.summarised

    def chosen(attn, z):
        calls.append(route(attn, z))
        return summarised and calls[-1]

    monkeypatch.setattr(merged, "summarised", chosen)
    _every_and_routed_match_the_oracle(engine, x, adapters)
    assert calls and all(calls)  # the merged block ran, and the CPU route was open to it


def test_the_cpu_route_is_taken_only_where_it_holds() -> None:
    engine = tiny_engine()
    attn = engine.base.blocks[0].attn
    z = torch.zeros(2, 5, engine.spec.width)
    with torch.no_grad():
        assert merged.summarised(attn, z)
    assert not merged.summarised(attn, z.requires_grad_())  # its log-sum-exp carries no gradient
    attn.fused_attn = False
    assert not merged.summarised(attn, z.detach())  # timm's explicit softmax: the keys read directly


def test_bfloat16_routes_agree(monkeypatch) -> None:
    # bfloat16 scores lose bits over ~200 keys: both routes soft-max in float32, and stay close.
    engine = tiny_engine().to(dtype=torch.bfloat16)
    adapters = _adapters(engine)
    x = images(engine)
    loaded = engine.prepare_set(adapters)
    with torch.no_grad():
        summary = engine(x, loaded)
        monkeypatch.setattr(merged, "summarised", lambda attn, z: False)
        direct = engine(x, loaded)
    scale = max(direct.adapters[a.name].abs().max().item() for a in adapters)
    for a in adapters:
        assert max_diff(summary.adapters[a.name], direct.adapters[a.name]) <= 0.05 * scale


@pytest.mark.parametrize("summarised", [True, False])
@pytest.mark.parametrize("variant", ["plain", "registers"])
def test_the_last_block_computes_only_the_rows_read(variant: str, summarised: bool, monkeypatch) -> None:
    """The base head reads row 0 (token pooling, the only one the engine serves: weights/spec.py), so
    the last block runs the prefix rows and the class-token rows alone (``merged_last_block``), and
    every logit stays the dense oracle's."""
    from memvit.memory_core.routing import planned

    engine = tiny_engine(variant)
    assert engine.resolved_trim  # the CPU's default (model.py)
    adapters = _adapters(engine)
    x = images(engine, batch=4)
    if not summarised:
        monkeypatch.setattr(merged, "summarised", lambda attn, z: False)
    trimmed = []
    last_block = planned.merged_last_block

    def spy(block, z, num_base, memory, read):
        out = last_block(block, z, num_base, memory, read)
        trimmed.append((z.shape[1], out.shape[1], read))
        return out

    monkeypatch.setattr(planned, "merged_last_block", spy)
    _every_and_routed_match_the_oracle(engine, x, adapters)
    T, read = engine.spec.num_tokens, engine.base.num_prefix_tokens  # registers: 5 prefix tokens
    assert trimmed == [(T + 4, read + 4, read), (T + 3, read + 3, read)]  # 4 rows shared, 3 routed


def test_the_last_block_is_trimmed_on_the_cpu_by_default_and_whole_when_asked(monkeypatch) -> None:
    """The CPU's default trims the last block (docs/design.md §2.1); ``trim_last_block = False``
    runs it whole; elsewhere the default is whole (the Triton path never trims)."""
    from memvit.memory_core.routing import planned

    engine = tiny_engine()
    calls = []
    monkeypatch.setattr(
        planned, "merged_last_block", lambda *a: calls.append(a) or merged.merged_last_block(*a)
    )
    loaded = engine.prepare_set(_adapters(engine))
    x = images(engine, batch=2)
    with torch.no_grad():
        engine(x, loaded)
        assert len(calls) == 1 and engine.trim_last_block is None and engine.resolved_trim
        engine.trim_last_block = False
        engine(x, loaded)
        assert len(calls) == 1
    engine.trim_last_block = None
    monkeypatch.setattr(type(engine), "device", property(lambda self: torch.device("cuda")))
    assert not engine.resolved_trim
