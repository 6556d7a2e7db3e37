"""The bfloat16 training pass from images (adapters/training/mixed_pass.py): the frozen base held in
bfloat16 once, so a step casts none of its weights and none of its rows' activations (autocast
over the float32 base cast each weight twice a block, every step), while the class-token rows
compute what autocast computed; the engine itself is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memvit.adapters.training.device import autocast
from memvit.adapters.training.mixed_pass import NORMS, HeldBase, HeldNorm, MixedPass, held_in
from memvit.adapters.training.step import TrainStep
from memvit.adapters.training.step_graph import WARM_UP
from memvit.memory_core.stored.cached import capture
from tests.adapters.training.test_step import _variants
from tests.conftest import VARIANTS, images, max_diff, tiny_engine

B = 6


def _casts(call) -> list[tuple[int, ...]]:
    """The input shapes of every dtype cast ``call`` makes."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as recorded:
        call()
    return [tuple(e.input_shapes[0]) for e in recorded.events() if e.name == "aten::_to_copy"]


def test_a_bfloat16_step_casts_no_base_weight_and_no_base_row() -> None:
    engine = tiny_engine().train()
    x, y = images(engine, batch=B), torch.tensor([0, 1, 2, 2, 1, 0])
    step = TrainStep(engine, _variants(engine, x), precision="bfloat16", rehearse=True)
    for _ in range(WARM_UP + 1):  # past the warm-up: the graph's route, as a GPU replays it
        step(x, y)
    casts = _casts(lambda: step(x, y))
    weights = {tuple(p.shape) for p in engine.base.parameters() if p.ndim >= 2}
    rows = (B, engine.spec.num_tokens, engine.spec.width)  # the base rows' activations
    assert casts and not [s for s in casts if s in weights or s == rows], casts
    assert casts.count(tuple(x.shape)) == 1  # the images, once, into the base's dtype
    step.flush()
    assert all(torch.isfinite(torch.tensor(v.losses)).all() for v in step.variants)


def test_the_base_is_held_in_bfloat16_once_and_the_engine_is_untouched() -> None:
    engine = tiny_engine()
    before = {k: v.clone() for k, v in engine.base.state_dict().items()}
    held = held_in(engine, torch.bfloat16)
    for name, p in held.named_parameters():
        full = ".full." in name  # a norm's float32 copy, for the class-token rows (HeldNorm)
        original = engine.base.get_parameter(name.replace(".low.", ".").replace(".full.", "."))
        assert p.dtype == (torch.float32 if full else torch.bfloat16), name
        assert not p.requires_grad
        assert p.data_ptr() != original.data_ptr()
        assert torch.equal(p, original.to(p.dtype))  # the same values, rounded once
    held_norms = [m for m in held.modules() if isinstance(m, HeldNorm)]
    inner = {id(n) for m in held_norms for n in (m.low, m.full)}
    assert held_norms and all(id(m) in inner for m in held.modules() if isinstance(m, NORMS))
    assert not held.training
    after = engine.base.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    with pytest.raises(ValueError, match="float32 runs the engine's own base"):
        MixedPass(engine, "float32")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_mixed_pass_computes_what_autocast_over_the_float32_base_did(variant: str) -> None:
    """Same class-token arithmetic (the same bfloat16 weights, norms in float32 from their
    bfloat16-rounded scales); the base rows round as a bfloat16 engine rounds them: logits and
    gradients agree to bfloat16's precision."""
    engine = tiny_engine(variant).train()
    x = images(engine, batch=B)
    variants = _variants(engine, x)
    params = [p for v in variants for p in v.adapter.parameters() if p.requires_grad]
    found = []
    for run in ("mixed", "autocast"):
        adapters = engine.prepare_set([v.adapter.live_weights() for v in variants])
        if run == "mixed":
            logits = MixedPass(engine, "bfloat16")(x, adapters)
        else:
            with autocast(x.device, "bfloat16"):
                logits = engine(x, adapters).adapters
        z = torch.stack([logits[v.name] for v in variants]).float()
        grads = torch.autograd.grad(z.square().sum(), params, allow_unused=True)
        found.append((z, grads))
    (z, grads), (z_autocast, grads_autocast) = found
    scale = z_autocast.abs().max().item()
    assert 0 < max_diff(z, z_autocast) <= 0.05 * scale
    for g, h in zip(grads, grads_autocast, strict=True):
        if g is not None:
            assert torch.nn.functional.cosine_similarity(g.flatten(), h.flatten(), dim=0) > 0.98


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_held_base_rows_are_a_bfloat16_engines(variant: str) -> None:
    """The base rows through the held base compute what a bfloat16 engine computes, bit for bit (its
    norms' scales in bfloat16 too)."""
    engine = tiny_engine(variant)
    x = images(engine, batch=B)
    held = capture(HeldBase(engine, "bfloat16"), x, "inputs")
    served = capture(tiny_engine(variant).to(torch.bfloat16), x, "inputs")  # the same seed's weights
    assert all(torch.equal(a, b) for a, b in zip(held, served, strict=True))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_norm_is_called_with_two_dtypes(variant: str) -> None:
    """A bfloat16 step from images calls every norm with its scales in its input's dtype: CUDA's layer
    norm refuses float32 scales with a bfloat16 input, the CPU's bfloat16 scales with a float32 one
    (its autocast leaves norms alone), so a mixed call fails on one device or the other."""
    engine = tiny_engine(variant).train()
    x, y = images(engine, batch=B), torch.tensor([0, 1, 2, 2, 1, 0])
    step = TrainStep(engine, _variants(engine, x), precision="bfloat16", graphs=False)
    step(x, y)  # makes the held base
    calls = []

    def seen(module, args) -> None:
        calls.append((args[0].dtype, module.weight.dtype))

    hooks = [
        m.register_forward_pre_hook(seen) for m in step.mixed.held.base.modules() if isinstance(m, NORMS)
    ]
    step(x, y)
    for hook in hooks:
        hook.remove()
    step.flush()
    assert calls and all(given == held for given, held in calls), calls
    assert {given for given, _ in calls} == {torch.bfloat16, torch.float32}  # both rows' norms ran
