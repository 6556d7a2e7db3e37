"""The joint optimiser step (adapters/training/update.py) is clip_grad_norm_ then SGD.step, variant
by variant: the same parameters and momentum buffers, step after step."""

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


def test_the_joint_step_is_each_variants_clip_and_sgd_step() -> None:
    joint_params, alone_params = _variants(), _variants()
    joint, alone = _optimizers(joint_params), _optimizers(alone_params)
    update = JointUpdate()
    clips = [c for *_, c in SETTINGS]
    for step in range(4):
        _grads(joint_params, step)
        _grads(alone_params, step)
        update(joint, clips)
        for params, optimizer, clip in zip(alone_params, alone, clips, strict=True):
            torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
        for mine, theirs in zip(joint_params, alone_params, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)  # clipped alike
    for o_joint, o_alone in zip(joint, alone, strict=True):
        for s, t in zip(o_joint.state.values(), o_alone.state.values(), strict=True):
            if t.get("momentum_buffer") is not None:
                torch.testing.assert_close(s["momentum_buffer"], t["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_a_schedule_after_the_joint_step_does_not_warn_and_resumes_from_its_state() -> None:
    params = _variants()
    optimizers = _optimizers(params)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in optimizers]
    update = JointUpdate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            _grads(params, step)
            update(optimizers, [1.0] * len(optimizers))
            for s in schedules:
                s.step()
    # The momentum buffers live where SGD keeps them: a state dict carries them to a fresh optimiser.
    restored = _optimizers(copy.deepcopy(params))
    for fresh, used in zip(restored, optimizers, strict=True):
        fresh.load_state_dict(used.state_dict())
        assert len(fresh.state) == len(used.state)


def test_the_joint_step_refuses_what_it_does_not_cover() -> None:
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="Nesterov"):
        JointUpdate()([torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)], [1.0])
