"""Adapters prepared for one engine, and stacked for a pass that trains them.

``PreparedAdapter`` is one adapter on the engine's device and dtype, its memory already projected to
keys and values. ``stack_adapters`` lays any tuple of them out as one ``AdapterStack``: class tokens
(K, D), per-layer memory padded to the longest (with a -inf bias on padding) and, in extension mode,
each adapter's ancestors. A stack keeps the autograd graph back to the adapters' parameters, so
training (and training from cached activations) runs it; an inference pass reads the engine's
device slots instead (memory_core/routing/slots.py), and never stacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..block.attention import LayerMemory
from ..errors import AdapterShapeError
from ..weights.adapter import AdapterWeights


@dataclass(frozen=True, eq=False)
class PreparedAdapter:
    """An adapter made ready for one engine: tensors on its device and dtype, memory projected.

    Built by ``MemoryViT.prepare`` for serving and for training alike (while training, the tensors
    carry the autograd graph back to the parameters).
    """

    name: str
    parent: str | None
    weights: AdapterWeights  # as given: describes the adapter, and re-prepares it on a move
    cls: Tensor  # (D,) class token plus the base class token's position embedding
    memory_keys: Tensor  # (L, H, m, d), constants: they do not depend on the image (docs/design.md §2.2)
    memory_values: Tensor  # (L, H, m, d)
    head_weight: Tensor  # (C, D)
    head_bias: Tensor  # (C,)
    # (L, m, D): the rows the keys and values are projected from, kept by training's stacked
    # projection (memory_core/stored/memory_projection.py) for the cached block; None when serving (an
    # adapter without memory has its empty rows either way).
    memory_inputs: Tensor | None = None


@dataclass(frozen=True)
class HeadGroup:
    """The heads of the adapters with one class count C, stacked: one batched matmul applies them all."""

    members: Tensor  # (G,) long: their positions among the stack's K adapters
    weight: Tensor  # (G, C, D)
    bias: Tensor  # (G, C)


@dataclass(frozen=True)
class AdapterStack:
    """The adapters of a set, stacked for the fused pass."""

    cls: Tensor  # (K, D)
    layers: tuple[LayerMemory, ...]  # one per block
    heads: tuple[tuple[Tensor, Tensor], ...]  # K (weight (C_k, D), bias (C_k,))
    # The same heads grouped by class count (the all-tasks stack only; a route applies the few heads
    # it asks for one by one, which measured faster than stacking them per pass: docs/design.md §2.7).
    head_groups: tuple[HeadGroup, ...] = ()

    def apply_heads(self, c: Tensor) -> list[Tensor]:
        """Class tokens (B, K, D) -> each adapter's logits (B, C_k), in stack order.

        One batched matmul per class count, not K small ones: with 1,000 adapters of 100 classes
        loaded that is 32 ms against 77 ms on CPU, and one kernel launch instead of 1,000 on a GPU.
        """
        if not self.head_groups:
            return [F.linear(c[:, k], w, b) for k, (w, b) in enumerate(self.heads)]
        logits: list[Tensor] = [c] * len(self.heads)  # every slot is overwritten below
        for group in self.head_groups:
            rows = c.index_select(1, group.members).transpose(0, 1)  # (G, B, D)
            z = torch.baddbmm(group.bias[:, None], rows, group.weight.transpose(1, 2))  # (G, B, C)
            for i, k in enumerate(group.members.tolist()):
                logits[k] = z[i]
        return logits

    @property
    def requires_grad(self) -> bool:
        """True when some tensor of the stack is being trained."""
        tensors = [self.cls, *(t for layer in self.layers for t in (layer.keys, layer.values))]
        tensors += [t for head in self.heads for t in head]
        return any(t.requires_grad for t in tensors)


def check_prepared_for(adapters: Iterable[PreparedAdapter], device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``AdapterShapeError`` unless every adapter was prepared for ``device`` and ``dtype``.

    A prepared adapter is fixed to the device and dtype of the engine that prepared it; after the
    engine moves, its old adapters must be prepared again (``LiveAdapters.move_to`` does).
    """
    for a in adapters:
        if a.cls.device != device or a.cls.dtype != dtype:
            raise AdapterShapeError(
                f"adapter {a.name!r} was prepared for {a.cls.device}/{a.cls.dtype}, not {device}/{dtype}: "
                "prepare it with the engine that runs it (LiveAdapters.move_to moves an engine and "
                "re-prepares its live adapters)",
                field="name",
            )


def stack_adapters(adapters: tuple[PreparedAdapter, ...], *, group_heads: bool = False) -> AdapterStack:
    """Stack ``adapters`` (each one's ancestors among them) for the fused pass.

    ``group_heads`` also stacks their heads by class count (``AdapterStack.apply_heads``): worth it
    for a stack that serves many passes, not for one built per pass."""
    stack = _build_stack(adapters, lineage_chains(adapters))
    if not group_heads:
        return stack
    return replace(stack, head_groups=_group_heads(adapters))


def lineage_chains(adapters: tuple[PreparedAdapter, ...]) -> list[list[int]]:
    """Per adapter, its stack position and then its ancestors' (parent first), all among ``adapters``."""
    by_name = {a.name: i for i, a in enumerate(adapters)}
    lineages = []
    for a in adapters:
        chain = [by_name[a.name]]
        while (parent := adapters[chain[-1]].parent) is not None:
            chain.append(by_name[parent])
        lineages.append(chain)
    return lineages


def _group_heads(adapters: tuple[PreparedAdapter, ...]) -> tuple[HeadGroup, ...]:
    by_classes: dict[int, list[int]] = {}
    for k, a in enumerate(adapters):
        by_classes.setdefault(a.head_weight.shape[0], []).append(k)
    device = adapters[0].cls.device
    return tuple(
        HeadGroup(
            members=torch.tensor(members, dtype=torch.long, device=device),
            weight=torch.stack([adapters[k].head_weight for k in members]),
            bias=torch.stack([adapters[k].head_bias for k in members]),
        )
        for members in by_classes.values()
    )


def _build_stack(adapters: tuple[PreparedAdapter, ...], lineages: list[list[int]]) -> AdapterStack:
    first = adapters[0]
    device, dtype = first.cls.device, first.cls.dtype
    # One device and dtype for all: torch would silently promote a mix while stacking.
    check_prepared_for(adapters, device, dtype)
    K = len(adapters)
    L, H, _, d = first.memory_keys.shape
    # Each adapter sees its own memory and, in extension mode, its ancestors'. Memory is constant,
    # so the ancestors' memory is simply folded into the adapter's own key/value list here. With no
    # memory anywhere P is 0 and the memory terms of attention are empty: no special case needed.
    visible = [sum(adapters[j].memory_keys.shape[2] for j in chain) for chain in lineages]
    P = max(visible)
    keys = torch.zeros(L, K, H, P, d, device=device, dtype=dtype)
    values = torch.zeros_like(keys)
    for k, chain in enumerate(lineages):
        if visible[k]:
            keys[:, k, :, : visible[k]] = torch.cat([adapters[j].memory_keys for j in chain], dim=2)
            values[:, k, :, : visible[k]] = torch.cat([adapters[j].memory_values for j in chain], dim=2)
    inputs = _stacked_inputs(adapters, lineages, visible, P)
    mem_bias = _padding_bias(visible, P, device, dtype)  # (K, P): -inf on padding
    # Class tokens each one attends to, itself first; shorter lineages are padded with their own
    # index under a -inf bias. In concatenation mode this is just (K, 1) = itself.
    A = max(len(chain) for chain in lineages)
    lineage = torch.tensor([chain + [chain[0]] * (A - len(chain)) for chain in lineages], device=device)
    lineage_bias = _padding_bias([len(chain) for chain in lineages], A, device, dtype)
    # unbind, not keys[layer]: one autograd node for all L layers when training, not one per layer
    rows = (None,) * L if inputs is None else inputs.unbind(0)
    layers = tuple(
        LayerMemory(keys=k, values=v, bias=mem_bias, lineage=lineage, lineage_bias=lineage_bias, inputs=r)
        for k, v, r in zip(keys.unbind(0), values.unbind(0), rows, strict=True)
    )
    return AdapterStack(
        cls=torch.stack([a.cls for a in adapters]),
        layers=layers,
        heads=tuple((a.head_weight, a.head_bias) for a in adapters),
    )


def _stacked_inputs(
    adapters: tuple[PreparedAdapter, ...], lineages: list[list[int]], visible: list[int], P: int
) -> Tensor | None:
    """The memory's rows (L, K, P, D), padded as the keys are; None unless every adapter kept them."""
    if any(a.memory_inputs is None for a in adapters):
        return None
    first = adapters[0].memory_inputs
    rows = first.new_zeros(first.shape[0], len(adapters), P, first.shape[-1])
    for k, chain in enumerate(lineages):
        if visible[k]:
            rows[:, k, : visible[k]] = torch.cat([adapters[j].memory_inputs for j in chain], dim=1)
    return rows


def _padding_bias(lengths: list[int], width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(len(lengths), width): 0 where a row has an entry, -inf on its padding."""
    positions = torch.arange(width, device=device)
    valid = positions[None, :] < torch.tensor(lengths, device=device)[:, None]
    return torch.zeros(valid.shape, device=device, dtype=dtype).masked_fill(~valid, float("-inf"))
