"""One adapter being trained: its parameters, optimiser and schedule (``Variant``), and the step
that trains any number of them from one fused pass over a batch (``fused_step``).

Rows never attend to each other, so the summed loss gives each adapter exactly the gradient it would
get alone; each has its own optimiser, learning rates, schedule and clipping, so each ends where it
would have ended alone (docs/design.md §2.8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memvit.memory_core import AdapterSet, MemoryViT, PreparedAdapter
from memvit.memory_core.cached import CachedBatch

from .config import TrainConfig
from .memory_init import token_memory
from .trainable import TrainableAdapter


def warmup_cosine(total: int, warmup: int) -> Callable[[int], float]:
    """LR multiplier per optimiser step: 0 -> 1 linearly over ``warmup`` steps, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Variant:
    """One adapter being trained: its parameters, optimiser and schedule, and what it has seen."""

    def __init__(
        self,
        engine: MemoryViT,
        config: TrainConfig,
        classes: tuple[str, ...],
        parent: PreparedAdapter | None,
        total: int,
        init_images: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        memory = None
        if config.memory_init == "tokens" and config.memory_tokens:
            assert init_images is not None, "memory_init='tokens' needs images"
            memory = token_memory(
                engine,
                init_images,
                config.memory_tokens,
                config.memory_norm,
                torch.Generator().manual_seed(config.start_seed + 1),
            )
        self.adapter = TrainableAdapter(
            engine,
            config.name,
            num_classes=len(classes),
            memory_tokens=config.memory_tokens,
            head_only=config.head_only,
            memory_norm=config.memory_norm,
            parent=parent,
            labels=classes,
            generator=torch.Generator().manual_seed(config.start_seed),
            memory=memory,
        )
        a = self.adapter
        self.params = [p for p in a.parameters() if p.requires_grad]
        groups = [{"params": list(a.head.parameters())}]
        if a.cls_token.requires_grad:
            groups.append({"params": [a.cls_token], "lr": config.lr * config.token_lr_scale})
        if a.memory.requires_grad:
            groups.append({"params": [a.memory], "lr": config.memory_lr})
        self.optimizer = torch.optim.SGD(
            groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
        warmup = max(1, round(config.warmup_fraction * total))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine(total, warmup))
        self.losses: list[float] = []
        self.curve: list[tuple[int, float]] = []
        self.correct = 0

    @property
    def name(self) -> str:
        return self.config.name

    def state(self) -> dict:
        return {
            "adapter": self.adapter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "losses": self.losses,
            "curve": self.curve,
        }

    def load_state(self, state: dict) -> None:
        self.adapter.load_state_dict(state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.losses = list(state["losses"])
        self.curve = [(int(s), float(a)) for s, a in state["curve"]]


def fused_step(
    engine: MemoryViT,
    variants: list[Variant],
    parent: PreparedAdapter | None,
    images: torch.Tensor | CachedBatch,
    labels: torch.Tensor,
) -> None:
    """One optimiser step for every variant, from one fused pass over the batch (the base runs once;
    from an activation cache, not at all)."""
    prepared = tuple(engine.prepare_many([v.adapter.live_weights() for v in variants]))
    out = engine(images, AdapterSet(((parent,) if parent else ()) + prepared))
    losses = [F.cross_entropy(out.adapters[v.name].float(), labels) for v in variants]
    for v in variants:
        v.optimizer.zero_grad(set_to_none=True)
    # Each loss depends on its own adapter's parameters only (rows never attend to each other), so
    # the sum's gradient for each adapter is that adapter's own loss gradient.
    torch.stack(losses).sum().backward()
    for v, loss in zip(variants, losses, strict=True):
        nn.utils.clip_grad_norm_(v.params, v.config.clip_grad)
        v.optimizer.step()
        v.schedule.step()
        v.losses.append(loss.item())
        v.correct += int((out.adapters[v.name].argmax(-1) == labels).sum())
