"""The optimiser step of every variant at once: gradient-norm clipping, then SGD with momentum.

Each variant keeps its own ``torch.optim.SGD`` (its parameter groups, learning rates set by its own
schedule, its momentum buffers: what a checkpoint saves) and is clipped by its own gradient norm,
exactly as ``clip_grad_norm_`` and ``SGD.step`` would do it variant by variant. Only the launches are
shared: the per-tensor norms of every variant in one ``_foreach_norm``, the variants' totals and
clip factors in a handful of small ops, and the momentum and parameter updates of every parameter
of every variant in three ``_foreach`` calls with a learning rate, momentum and weight decay per
tensor. Variant by variant, torch's own path costs about 25 launches and as many Python-level calls
per variant; with a sweep of 8 on a GPU, where a small base's step is bound by launches, that was a
visible part of the step (benchmarks/gpu/training.py measures 8 variants against 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Layout:
    """Which variant each trained tensor belongs to, on the device (built once per run)."""

    key: tuple
    owner: Tensor  # (N,) variant index per tensor
    max_norm: Tensor  # (K,) each variant's clip


def _params(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, dict]]:
    return [(p, group) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class JointUpdate:
    """``clip_grad_norm_(params, clip)`` then ``optimizer.step()`` for each (optimizer, clip), together."""

    def __init__(self) -> None:
        self._layout: _Layout | None = None

    @torch.no_grad()
    def __call__(self, optimizers: Sequence[torch.optim.Optimizer], clips: Sequence[float]) -> None:
        per_variant = [_params(o) for o in optimizers]
        tensors = [(p, group, k) for k, items in enumerate(per_variant) for p, group in items]
        if not tensors:
            return
        params = [p for p, _, _ in tensors]
        grads = [p.grad for p in params]
        self._clip(per_variant, grads, clips, params[0].device)
        self._sgd(optimizers, tensors, grads)
        for o in optimizers:
            o._opt_called = True  # what SGD.step marks, so that the schedule's step does not warn

    def _layout_for(self, per_variant: list, clips: Sequence[float], device: torch.device) -> _Layout:
        key = (tuple(len(items) for items in per_variant), tuple(clips), device)
        if self._layout is None or self._layout.key != key:
            owner = [k for k, items in enumerate(per_variant) for _ in items]
            self._layout = _Layout(
                key,
                torch.tensor(owner, device=device),
                torch.tensor(list(clips), dtype=torch.float32, device=device),
            )
        return self._layout

    def _clip(self, per_variant: list, grads: list[Tensor], clips: Sequence[float], device) -> None:
        """Each variant's gradients scaled by min(1, clip / (its total norm + 1e-6)), as clip_grad_norm_."""
        layout = self._layout_for(per_variant, clips, device)
        norms = torch.stack(torch._foreach_norm(grads)).float()  # (N,) one per tensor
        totals = torch.zeros(len(per_variant), device=device).index_add_(0, layout.owner, norms * norms)
        factors = (layout.max_norm / (totals.sqrt() + 1e-6)).clamp(max=1.0)  # (K,)
        start = 0
        for k, items in enumerate(per_variant):
            if items:
                torch._foreach_mul_(grads[start : start + len(items)], factors[k])
                start += len(items)

    @staticmethod
    def _sgd(optimizers: Sequence[torch.optim.Optimizer], tensors: list, grads: list[Tensor]) -> None:
        """SGD (momentum, weight decay; no dampening, no Nesterov) with each tensor's group settings."""
        for group in (g for o in optimizers for g in o.param_groups):
            if group.get("dampening", 0) or group.get("nesterov") or group.get("maximize"):
                raise ValueError("the joint update covers SGD without dampening, Nesterov or maximize")
        params = [p for p, _, _ in tensors]
        decay = [group["weight_decay"] for _, group, _ in tensors]
        if any(decay):
            grads = torch._foreach_add(grads, torch._foreach_mul(params, decay))
        steps: list[Tensor] = []
        moving, momenta, buffers = [], [], []
        for (p, group, k), g in zip(tensors, grads, strict=True):
            if not group["momentum"]:
                steps.append(g)
                continue
            state = optimizers[k].state[p]
            buffer = state.get("momentum_buffer")
            if buffer is None:  # the first step: the buffer starts as the gradient
                buffer = state["momentum_buffer"] = g.detach().clone()
            else:
                moving.append(g)
                momenta.append(group["momentum"])
                buffers.append(buffer)
            steps.append(buffer)
        if buffers:
            torch._foreach_mul_(buffers, momenta)
            torch._foreach_add_(buffers, moving)
        torch._foreach_add_(params, torch._foreach_mul(steps, [-group["lr"] for _, group, _ in tensors]))
