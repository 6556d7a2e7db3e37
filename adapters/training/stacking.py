"""A training step's adapters stacked for the fused pass, with no value from the host on any step.

``stack_adapters`` (memory_core/sets/stack.py) builds a stack's constant parts on every call: the
padding biases and lineage indices come from Python lists through ``torch.tensor``, each a small
blocking copy from the host on a GPU, and none of them allowed inside a CUDA graph capture. What
they say depends only on the run's layout (which adapters, their ancestors, their memory sizes), the
same for every step. So ``StackLayout`` is made once per run from memory_core's own stack, keeps
those constants on the device, and ``stack`` rebuilds only what depends on the parameters, with the
operations ``stack_adapters`` runs (the same numbers, bit for bit, and the same autograd graph back
to the parameters: tests/adapters/training/test_stacking.py). Heads are not grouped: a training
stack applies them one by one (``AdapterStack.apply_heads`` would read its groups back to the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from memvit.memory_core import PreparedAdapter
from memvit.memory_core.block.attention import LayerMemory
from memvit.memory_core.sets.stack import AdapterStack, lineage_chains, stack_adapters


def _key(adapters: tuple[PreparedAdapter, ...]) -> tuple:
    """What a layout depends on: names, parents, memory sizes, and the tensors' shapes and place."""
    first = adapters[0]
    return (
        tuple((a.name, a.parent, a.memory_keys.shape[2], a.memory_inputs is None) for a in adapters),
        tuple(first.memory_keys.shape),
        first.cls.device,
        first.cls.dtype,
    )


@dataclass(frozen=True, eq=False)
class StackLayout:
    """The constant parts of one run's stacks (on the device), and how to stack the rest."""

    key: tuple
    lineages: tuple[tuple[int, ...], ...]  # per adapter: itself, then its ancestors (stack positions)
    visible: tuple[int, ...]  # per adapter: memory rows it sees (its own and its ancestors')
    width: int  # P: the longest
    bias: Tensor  # (K, P) 0 / -inf on padding
    lineage: Tensor  # (K, A) long
    lineage_bias: Tensor  # (K, A)

    @classmethod
    def of(cls, adapters: tuple[PreparedAdapter, ...]) -> StackLayout:
        """The layout of ``adapters``, its constants taken from memory_core's own stack of them."""
        stack = stack_adapters(adapters)
        layer = stack.layers[0]
        lineages = [tuple(chain) for chain in lineage_chains(adapters)]
        visible = tuple(sum(adapters[j].memory_keys.shape[2] for j in chain) for chain in lineages)
        return cls(
            key=_key(adapters),
            lineages=tuple(lineages),
            visible=visible,
            width=layer.keys.shape[2],
            bias=layer.bias,
            lineage=layer.lineage,
            lineage_bias=layer.lineage_bias,
        )

    def fits(self, adapters: tuple[PreparedAdapter, ...]) -> bool:
        return _key(adapters) == self.key

    def stack(self, adapters: tuple[PreparedAdapter, ...]) -> AdapterStack:
        """``stack_adapters(adapters)`` without grouped heads, from this layout's constants."""
        if not self.fits(adapters):
            raise ValueError("these adapters do not have this layout: make a new one (StackLayout.of)")
        first = adapters[0]
        device, dtype = first.cls.device, first.cls.dtype
        K, P = len(adapters), self.width
        L, H, _, d = first.memory_keys.shape
        keys = torch.zeros(L, K, H, P, d, device=device, dtype=dtype)
        values = torch.zeros_like(keys)
        for k, chain in enumerate(self.lineages):
            if self.visible[k]:
                keys[:, k, :, : self.visible[k]] = torch.cat([adapters[j].memory_keys for j in chain], dim=2)
                values[:, k, :, : self.visible[k]] = torch.cat(
                    [adapters[j].memory_values for j in chain], dim=2
                )
        inputs = self._inputs(adapters)
        rows = (None,) * L if inputs is None else inputs.unbind(0)  # one autograd node for all layers
        layers = tuple(
            LayerMemory(
                keys=k,
                values=v,
                bias=self.bias,
                lineage=self.lineage,
                lineage_bias=self.lineage_bias,
                inputs=r,
            )
            for k, v, r in zip(keys.unbind(0), values.unbind(0), rows, strict=True)
        )
        return AdapterStack(
            cls=torch.stack([a.cls for a in adapters]),
            layers=layers,
            heads=tuple((a.head_weight, a.head_bias) for a in adapters),
        )

    def _inputs(self, adapters: tuple[PreparedAdapter, ...]) -> Tensor | None:
        """The memory's rows (L, K, P, D), padded as the keys are; None unless every adapter kept them."""
        if any(a.memory_inputs is None for a in adapters):
            return None
        first = adapters[0].memory_inputs
        assert first is not None
        rows = first.new_zeros(first.shape[0], len(adapters), self.width, first.shape[-1])
        for k, chain in enumerate(self.lineages):
            if self.visible[k]:
                rows[:, k, : self.visible[k]] = torch.cat([adapters[j].memory_inputs for j in chain], dim=1)  # type: ignore[misc]
        return rows
