"""One adapter being trained: its parameters, optimiser and schedule (``Variant``), on the engine's
device. The step that trains any number of them from one pass over a batch is step.py's
(``TrainStep``); their optimiser steps run together (update.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from memvit.memory_core import MemoryViT, PreparedAdapter

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
        # Initialised on the host from seeded CPU generators (the same start on every device), then
        # moved: the optimiser is made for the parameters where they train.
        a = self.adapter.to(engine.device)
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
