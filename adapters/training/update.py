"""The optimiser step of every variant at once: gradient-norm clipping, then SGD with momentum.

Each variant keeps its own ``torch.optim.SGD`` (its parameter groups, learning rates set by its own
schedule, its momentum buffers: what a checkpoint saves) and is clipped by its own gradient norm,
exactly as ``clip_grad_norm_`` and ``SGD.step`` would do it variant by variant. Only the launches are
shared: the per-tensor norms of every variant in one ``_foreach_norm``, the variants' totals and
clip factors in a handful of small ops, and the momentum and parameter updates of every parameter
of every variant in three ``_foreach`` calls with a learning rate, momentum and weight decay per
tensor. Variant by variant, torch's own path costs about 25 launches and as many Python-level calls
per variant (benchmarks/gpu/training.py measures 8 variants against 1).

The update reads no value from the host, so a CUDA graph can hold it (step_graph.py): its gradients
come as arguments (the step's ``autograd.grad``), the learning rates, which the schedules change on
the host every step, from a tensor on the device that ``load_rates`` refreshes before the step
(one copy from pinned memory, not waited for), the clips and the variant of each tensor from tensors
made once per layout. Momentum and weight decay are constants of a run; ``key`` says what a
captured update depends on (those constants and the momentum buffers themselves), so that a
changed one is noticed, not silently replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Layout:
    """Which variant each updated tensor belongs to, on the device (built once per layout)."""

    key: tuple
    owner: Tensor  # (N,) variant index per updated tensor
    max_norm: Tensor  # (K,) each variant's clip


class _Same:
    """An object compared by identity, and held: a key that holds its buffers cannot see a new one
    made at a freed one's address (``id`` alone could)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _laid_out(p: Tensor, g: Tensor | None) -> Tensor | None:
    """``g`` laid out as ``p.grad`` would hold it (``AccumulateGrad``'s layout contract): a gradient
    from ``autograd.grad`` may be a view into a larger one (a chunk's memory, split), and a norm over
    other strides sums in another order. Copied only when its strides break the contract."""
    if g is None:
        return g
    if _dense(p):  # p's strides, wherever a size is not 1 (and no 0 stride where it is)
        pairs = zip(g.shape, g.stride(), p.stride(), strict=True)
        if all(gs == ps if n != 1 else gs != 0 for n, gs, ps in pairs):
            return g
        return torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.contiguous()


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its span of memory exactly once (non-overlapping and dense)."""
    expected = 1
    for size, stride in sorted(
        ((n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1), key=lambda x: x[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


class JointUpdate:
    """``clip_grad_norm_(params, clip)`` then ``optimizer.step()`` for each (optimizer, clip), together,
    from the gradients given (aligned with ``params``; None: a tensor the loss does not reach)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], clips: Sequence[float]) -> None:
        self.optimizers, self.clips = list(optimizers), list(clips)
        for group in (g for o in self.optimizers for g in o.param_groups):
            if group.get("dampening", 0) or group.get("nesterov") or group.get("maximize"):
                raise ValueError("the joint update covers SGD without dampening, Nesterov or maximize")
        self.params = [p for p, _, _ in self.entries]  # fixed: what the step differentiates for
        self._rates: Tensor | None = None  # (N,) -lr per tensor, on the device
        self._loaded: list[float] | None = None
        self._layout: _Layout | None = None
        self._moved: list[bool] | None = None  # which tensors the last update moved (had a gradient)

    @property
    def entries(self) -> list[tuple[Tensor, dict, int]]:
        """(parameter, its group, its variant), in the optimisers' order. Read afresh: loading an
        optimiser's state (a resumed run) replaces its group dicts, not its parameters."""
        entries = [
            (p, g, k) for k, o in enumerate(self.optimizers) for g in o.param_groups for p in g["params"]
        ]
        if hasattr(self, "params") and any(
            p is not q for (p, _, _), q in zip(entries, self.params, strict=True)
        ):
            raise ValueError("the optimisers' parameters changed since the update was made")
        return entries

    def load_rates(self) -> None:
        """Each tensor's current learning rate (negated) into the device tensor the update reads:
        before each step, outside a graph; nothing is copied when no rate changed."""
        rates = [-float(group["lr"]) for _, group, _ in self.entries]
        if rates == self._loaded:
            return
        device = self.params[0].device
        if self._rates is None:
            self._rates = torch.empty(len(rates), dtype=torch.float32, device=device)
        pinned = device.type == "cuda"  # a new pinned buffer per copy: the copy may still be queued
        self._rates.copy_(torch.tensor(rates, dtype=torch.float32, pin_memory=pinned), non_blocking=pinned)
        self._loaded = rates

    def key(self) -> tuple:
        """What a captured update bakes in besides its tensors' contents: momentum, weight decay and
        the momentum buffers (by identity), the clips. A new key means capturing again."""
        state = [o.state for o in self.optimizers]
        return tuple(self.clips), tuple(
            (g["momentum"], g["weight_decay"], _Same(state[k].get(p, {}).get("momentum_buffer")))
            for p, g, k in self.entries
        )

    def ready(self) -> bool:
        """Whether every tensor the last update moved with momentum has its buffer: the first step
        makes them (as SGD does), which a graph cannot (it would make them again on every replay).
        False before any update: which tensors get a gradient is known from one."""
        if self._moved is None:
            return False
        return all(
            not g["momentum"] or not moved or "momentum_buffer" in self.optimizers[k].state.get(p, {})
            for (p, g, k), moved in zip(self.entries, self._moved, strict=True)
        )

    @torch.no_grad()
    def __call__(self, grads: Sequence[Tensor | None]) -> None:
        if self._rates is None:
            self.load_rates()
        assert self._rates is not None
        rates = self._rates.unbind(0)
        grads = [_laid_out(p, g) for p, g in zip(self.params, grads, strict=True)]
        tensors = [
            (p, group, k, g, r) for (p, group, k), g, r in zip(self.entries, grads, rates, strict=True)
        ]
        self._moved = [t[3] is not None for t in tensors]
        tensors = [t for t in tensors if t[3] is not None]
        if not tensors:
            return
        self._clip([(k, g) for _, _, k, g, _ in tensors], tensors[0][0].device)
        self._sgd(tensors)
        for o in self.optimizers:
            o._opt_called = True  # what SGD.step marks, so that the schedule's step does not warn

    def _layout_for(self, owners: list[int], device: torch.device) -> _Layout:
        key = (tuple(owners), tuple(self.clips), device)
        if self._layout is None or self._layout.key != key:
            self._layout = _Layout(
                key,
                torch.tensor(owners, device=device),
                torch.tensor(self.clips, dtype=torch.float32, device=device),
            )
        return self._layout

    def _clip(self, items: list[tuple[int, Tensor]], device: torch.device) -> None:
        """Each variant's gradients scaled by min(1, clip / (its total norm + 1e-6)), as clip_grad_norm_."""
        layout = self._layout_for([k for k, _ in items], device)
        grads = [g for _, g in items]
        norms = torch.stack(torch._foreach_norm(grads)).float()  # (N,) one per tensor
        totals = torch.zeros(len(self.optimizers), device=device).index_add_(0, layout.owner, norms * norms)
        factors = (layout.max_norm / (totals.sqrt() + 1e-6)).clamp(max=1.0)  # (K,)
        start = 0
        while start < len(items):  # each variant's tensors are contiguous
            k = items[start][0]
            end = start
            while end < len(items) and items[end][0] == k:
                end += 1
            torch._foreach_mul_(grads[start:end], factors[k])
            start = end

    def _sgd(self, tensors: list) -> None:
        """SGD (momentum, weight decay; no dampening, no Nesterov) with each tensor's group settings."""
        params = [p for p, *_ in tensors]
        grads = [g for _, _, _, g, _ in tensors]
        decay = [group["weight_decay"] for _, group, *_ in tensors]
        if any(decay):
            grads = torch._foreach_add(grads, torch._foreach_mul(params, decay))
        steps: list[Tensor] = []
        moving, momenta, buffers = [], [], []
        for (p, group, k, _, _), g in zip(tensors, grads, strict=True):
            if not group["momentum"]:
                steps.append(g)
                continue
            state = self.optimizers[k].state[p]
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
        torch._foreach_add_(params, torch._foreach_mul(steps, [r for *_, r in tensors]))
