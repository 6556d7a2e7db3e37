"""An adapter being trained: its parameters, and the fused-pass stack built from them each step.

Which parameters learn is the regime (the paper's Table 2 rows):

    head-only             the head; the class token stays the base's, no memory
    class token + head    the class token and the head (``memory_tokens = 0``)
    memory N              the class token, N memory tokens per layer and the head

In extension mode the parent adapter is part of the stack, frozen, and the new class token also
attends to the parent's class token and memory, exactly as it will when served.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from memory_core import AdapterSet, AdapterStack, AdapterWeights, MemoryViT, PreparedAdapter
from memory_core.adapter import MEMORY_INIT_STD

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
    ) -> None:
        super().__init__()
        if head_only and memory_tokens:
            raise ValueError("head-only training has no memory tokens; use memory_tokens=0")
        if memory_tokens < 0:
            raise ValueError(f"memory_tokens must be >= 0, got {memory_tokens}")
        spec = engine.spec
        self.engine = [engine]  # a list, so the frozen base is not registered as a submodule
        self.name, self.memory_norm, self.labels = name, memory_norm, labels
        self.parent = parent
        # The paper starts the new class token from the base's and the memory from N(0, 0.02).
        base_cls = engine.base.cls_token.detach().reshape(-1).float().cpu()
        self.cls_token = nn.Parameter(base_cls.clone(), requires_grad=not head_only)
        memory = torch.randn(spec.depth, memory_tokens, spec.width, generator=generator) * MEMORY_INIT_STD
        self.memory = nn.Parameter(memory, requires_grad=memory_tokens > 0)
        self.head = nn.Linear(spec.width, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def regime(self) -> Regime:
        if not self.cls_token.requires_grad:
            return "head-only"
        return "memory" if self.memory.shape[1] else "class-token"

    def weights(self) -> AdapterWeights:
        """A detached snapshot, as a bundle stores it."""
        return AdapterWeights(
            name=self.name,
            memory=self.memory.detach().cpu().clone(),
            cls_token=self.cls_token.detach().cpu().clone(),
            head_weight=self.head.weight.detach().cpu().clone(),
            head_bias=self.head.bias.detach().cpu().clone(),
            memory_norm=self.memory_norm,
            parent=None if self.parent is None else self.parent.name,
            labels=self.labels,
        )

    def adapter_set(self) -> AdapterSet:
        """The set this adapter is trained (and validated) in, built from the live parameters.

        The memory keys and values are projected through the frozen blocks with autograd on, so the
        loss reaches the memory tokens through them.
        """
        engine = self.engine[0]
        like = {"device": engine.device, "dtype": engine.dtype}
        keys, values = engine.project_memory(self.memory.to(**like), self.memory_norm)
        prepared = PreparedAdapter(
            weights=_placeholder(self),
            cls=self.cls_token.to(**like) + engine.class_position(),
            memory_keys=keys,
            memory_values=values,
            head_weight=self.head.weight.to(**like),
            head_bias=self.head.bias.to(**like),
        )
        return AdapterSet((prepared,) if self.parent is None else (self.parent, prepared))

    def forward(self, images: Tensor) -> Tensor:
        """Images -> this adapter's logits (B, C), through the fused pass with only this set loaded."""
        adapter_set = self.adapter_set()
        stack: AdapterStack = adapter_set.stack
        _, c = self.engine[0].forward_features(images, stack)
        weight, bias = stack.heads[-1]
        return nn.functional.linear(c[:, -1], weight, bias)


def _placeholder(adapter: TrainableAdapter) -> AdapterWeights:
    # AdapterSet only reads name and parent from it; the tensors are the live parameters (no copy).
    return AdapterWeights(
        name=adapter.name,
        memory=adapter.memory,
        cls_token=adapter.cls_token,
        head_weight=adapter.head.weight,
        head_bias=adapter.head.bias,
        memory_norm=adapter.memory_norm,
        parent=None if adapter.parent is None else adapter.parent.name,
    )
