"""An adapter being trained: its parameters, and the adapter set built from them each step.

Which parameters learn is the regime (the paper's Table 2 rows):

    head-only             the head; the class token stays the base's, no memory
    class token + head    the class token and the head (``memory_tokens = 0``)
    memory N              the class token, N memory tokens per layer and the head

The parameters start from ``AdapterWeights.initialise`` (the paper's initialisation) and go through
``MemoryViT.prepare`` on every step exactly as a served adapter does, so training sees the pass it
will be served with. In extension mode the parent adapter is part of the set, frozen, and the new
class token also attends to the parent's class token and memory.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from memvit.memory_core import AdapterSet, AdapterWeights, MemoryViT, PreparedAdapter

Regime = Literal["head-only", "class-token", "memory"]


class TrainableAdapter(nn.Module):
    def __init__(
        self,
        engine: MemoryViT,
        name: str,
        *,
        num_classes: int,
        memory_tokens: int,
        head_only: bool = False,
        memory_norm: str = "norm1",
        parent: PreparedAdapter | None = None,
        labels: tuple[str, ...] | None = None,
        generator: torch.Generator | None = None,
        memory: Tensor | None = None,
    ) -> None:
        """``memory``: where the memory tokens start, (L, m, D) (default: the paper's N(0, 0.02))."""
        super().__init__()
        if head_only and memory_tokens:
            raise ValueError("head-only training has no memory tokens; use memory_tokens=0")
        start = AdapterWeights.initialise(
            name,
            engine.spec,
            num_memory=memory_tokens,
            num_classes=num_classes,
            cls_token=engine.base.cls_token,
            memory_norm=memory_norm,
            parent=None if parent is None else parent.name,
            labels=labels,
            generator=generator,
        )
        self.engine = [engine]  # a list, so the frozen base is not registered as a submodule
        self.name, self.memory_norm, self.labels = name, memory_norm, labels
        self.parent = parent
        self.cls_token = nn.Parameter(start.cls_token, requires_grad=not head_only)
        if memory is not None and memory.shape != start.memory.shape:
            raise ValueError(f"initial memory {tuple(memory.shape)}, expected {tuple(start.memory.shape)}")
        start_memory = start.memory if memory is None else memory.detach().float().cpu().clone()
        self.memory = nn.Parameter(start_memory, requires_grad=memory_tokens > 0)
        self.head = nn.Linear(engine.spec.width, num_classes)
        with torch.no_grad():
            self.head.weight.copy_(start.head_weight)
            self.head.bias.copy_(start.head_bias)

    @property
    def regime(self) -> Regime:
        if not self.cls_token.requires_grad:
            return "head-only"
        return "memory" if self.memory.shape[1] else "class-token"

    def _weights(self, tensors: dict[str, Tensor], *, check_values: bool = True) -> AdapterWeights:
        return AdapterWeights(
            name=self.name,
            **tensors,
            memory_norm=self.memory_norm,
            parent=None if self.parent is None else self.parent.name,
            labels=self.labels,
            check_values=check_values,
        )

    def _tensors(self) -> dict[str, Tensor]:
        return {
            "memory": self.memory,
            "cls_token": self.cls_token,
            "head_weight": self.head.weight,
            "head_bias": self.head.bias,
        }

    def live_weights(self) -> AdapterWeights:
        """The parameters themselves (no copy): what ``prepare`` differentiates through. Built every
        step, so their values are not checked here (``weights``, what a bundle stores, checks them)."""
        return self._weights(self._tensors(), check_values=False)

    def weights(self) -> AdapterWeights:
        """A detached snapshot, as a bundle stores it."""
        return self._weights({key: t.detach().cpu().clone() for key, t in self._tensors().items()})

    def adapter_set(self) -> AdapterSet:
        """The set this adapter is trained (and validated) in, built from the live parameters."""
        prepared = self.engine[0].prepare(self.live_weights())
        return AdapterSet((prepared,) if self.parent is None else (self.parent, prepared))

    def forward(self, images: Tensor) -> Tensor:
        """Images -> this adapter's logits (B, C), through the fused pass with only this set loaded."""
        return self.engine[0](images, self.adapter_set()).adapters[self.name]
