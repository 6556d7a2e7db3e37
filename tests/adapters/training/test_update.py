"""The joint optimiser step (adapters/training/update.py) is clip_grad_norm_ then SGD.step, variant
by variant: the same parameters and momentum buffers, step after step, with the learning rates the
schedules set read from a device tensor and gradients given as ``autograd.grad`` returns them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from memvit.adapters.training.update import JointUpdate

# (lr, momentum, weight decay, clip) per variant: clipped and not, with and without momentum and decay
SETTINGS = [(0.1, 0.9, 0.0, 0.05), (0.5, 0.0, 0.01, 10.0), (0.03, 0.9, 0.001, 1.0)]


def _variants(seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (4,), (2, 0, 4), (5,)]  # an empty tensor too: memory of 0 tokens
    return [[torch.randn(s, generator=g).requires_grad_() for s in shapes] for _ in SETTINGS]


def _optimizers(variants) -> list[torch.optim.SGD]:
    made = []
    for params, (lr, momentum, decay, _) in zip(variants, SETTINGS, strict=True):
        # Two groups with their own lr, as a variant's head and class token have.
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": lr * 30}]
        made.append(torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=decay))
    return made


def _grads(variants, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for params in variants:
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * (1 + step)


def _given(update: JointUpdate) -> list[torch.Tensor]:
    """The gradients as the step hands them over: arguments, each a view into a larger tensor (as a
    chunk's split memory comes back from ``autograd.grad``); ``p.grad`` is not read."""
    grads = [torch.stack([p.grad, p.grad])[1] if p.grad.numel() else p.grad for p in update.params]
    for p in update.params:
        p.grad = None
    return grads


def test_the_joint_step_is_each_variants_clip_and_sgd_step() -> None:
    joint_params, alone_params = _variants(), _variants()
    joint, alone = _optimizers(joint_params), _optimizers(alone_params)
    clips = [c for *_, c in SETTINGS]
    update = JointUpdate(joint, clips)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in joint + alone]
    for step in range(4):
        _grads(joint_params, step)
        _grads(alone_params, step)
        update.load_rates()  # the rates the schedules set for this step
        update(_given(update))
        for params, optimizer, clip in zip(alone_params, alone, clips, strict=True):
            torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
        for s in schedules:
            s.step()
        for mine, theirs in zip(joint_params, alone_params, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for o_joint, o_alone in zip(joint, alone, strict=True):
        for s, t in zip(o_joint.state.values(), o_alone.state.values(), strict=True):
            if t.get("momentum_buffer") is not None:
                torch.testing.assert_close(s["momentum_buffer"], t["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_a_schedule_after_the_joint_step_does_not_warn_and_resumes_from_its_state() -> None:
    params = _variants()
    optimizers = _optimizers(params)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in optimizers]
    update = JointUpdate(optimizers, [1.0] * len(optimizers))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _grads(params, step)
            update.load_rates()
            update(_given(update))
            for s in schedules:
                s.step()
    # The momentum buffers live where SGD keeps them: a state dict carries them to a fresh optimiser.
    restored = _optimizers(copy.deepcopy(params))
    for fresh, used in zip(restored, optimizers, strict=True):
        fresh.load_state_dict(used.state_dict())
        assert len(fresh.state) == len(used.state)


def test_the_joint_step_refuses_what_it_does_not_cover() -> None:
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="Nesterov"):
        JointUpdate([torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)], [1.0])


def test_what_a_captured_update_bakes_in_is_in_its_key() -> None:
    params = _variants()
    optimizers = _optimizers(params)
    update = JointUpdate(optimizers, [1.0] * len(optimizers))
    assert not update.ready()  # no momentum buffers before the first step
    before = update.key()
    _grads(params, 0)
    update(_given(update))
    assert update.ready() and update.key() != before  # the first step made the buffers
    after = update.key()
    _grads(params, 1)
    update.load_rates()
    update(_given(update))
    assert update.key() == after  # buffers updated in place; learning rates are not in the key
    for o in optimizers:
        o.load_state_dict(copy.deepcopy(o.state_dict()))  # new buffers, as a resumed run has
    assert update.key() != after
    optimizers[0].param_groups[0]["momentum"] = 0.5
    assert update.key() != after


def test_rates_are_copied_only_when_a_schedule_changed_them() -> None:
    optimizers = _optimizers(_variants())
    update = JointUpdate(optimizers, [1.0] * len(optimizers))
    update.load_rates()
    rates = update._rates
    assert rates is not None
    expected = [-g["lr"] for o in optimizers for g in o.param_groups for _ in g["params"]]
    assert rates.tolist() == pytest.approx(expected)
    version = rates._version
    update.load_rates()
    assert rates._version == version  # unchanged: nothing copied
    optimizers[1].param_groups[1]["lr"] = 7.0
    update.load_rates()
    assert update._rates is rates and rates._version > version  # the same tensor, refreshed in place
    assert -7.0 in rates.tolist()
    # Loading an optimiser's state (a resumed run) replaces its groups: the rates follow the new ones.
    state = copy.deepcopy(optimizers[2].state_dict())
    state["param_groups"][0]["lr"] = 9.0
    optimizers[2].load_state_dict(state)
    update.load_rates()
    assert -9.0 in rates.tolist()


def test_a_tensor_the_loss_does_not_reach_is_left_alone_and_does_not_hold_up_capture() -> None:
    params = _variants()
    optimizers = _optimizers(params)
    update = JointUpdate(optimizers, [1.0] * len(optimizers))
    before = [p.detach().clone() for p in update.params]
    _grads(params, 0)
    grads = _given(update)
    grads[0] = None  # as autograd.grad gives for a tensor the loss does not reach (allow_unused)
    update(grads)
    assert torch.equal(update.params[0], before[0]) and not torch.equal(update.params[1], before[1])
    assert update.params[0] not in optimizers[0].state  # no momentum buffer, as SGD.step leaves it
    assert update.ready()  # every tensor that moved has its buffer
