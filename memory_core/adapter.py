"""One adapter's learned parameters: per-layer memory, a class token and a head.

``AdapterWeights`` is the in-memory form of a bundle (the file format lives in ``adapters/``). It is
immutable and checks that its tensors fit together when built; ``check_fits`` checks that they fit a
given base model. Both run before anything is copied into a live adapter set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .errors import AdapterShapeError
from .spec import ViTSpec

MemoryNorm = Literal["norm1", "none"]
MEMORY_NORMS: tuple[str, ...] = ("norm1", "none")

# Adapter names travel in URLs, file names and JSON keys; keep them boring.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# The base model's own task answers under this name, so no adapter may take it.
BASE_TASK = "base"

MEMORY_INIT_STD = 0.02  # the paper's N(0, 0.02) initialisation of memory tokens


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise AdapterShapeError(
            f"invalid adapter name {name!r}: use 1-64 characters from a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            field="name",
        )
    if name == BASE_TASK:
        raise AdapterShapeError(f"the name {BASE_TASK!r} is reserved for the base model's task", field="name")


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """Parameters of one adapter. Tensors are (L, m, D), (D,), (C, D) and (C,)."""

    name: str
    memory: Tensor  # (L, m, D): m memory tokens per layer, m >= 0
    cls_token: Tensor  # (D,): the adapter's class token, before the position embedding
    head_weight: Tensor  # (C, D)
    head_bias: Tensor  # (C,)
    memory_norm: MemoryNorm = "norm1"
    parent: str | None = None  # extension mode: the adapter whose tokens this one also attends to
    labels: tuple[str, ...] | None = None  # C class names, if known
    extra: dict = field(default_factory=dict)  # free-form metadata carried along (training record, ...)

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.parent is not None:
            check_name(self.parent)
            if self.parent == self.name:
                raise AdapterShapeError(f"adapter {self.name!r} names itself as its parent", field="parent")
        if self.memory_norm not in MEMORY_NORMS:
            raise AdapterShapeError(
                f"memory_norm must be one of {MEMORY_NORMS}, got {self.memory_norm!r}", field="memory_norm"
            )
        for key in ("memory", "cls_token", "head_weight", "head_bias"):
            t = getattr(self, key)
            if not isinstance(t, Tensor):
                raise AdapterShapeError(f"{key} must be a tensor, got {type(t).__name__}", field=key)
            if not t.is_floating_point():
                raise AdapterShapeError(f"{key} must be a floating-point tensor, got {t.dtype}", field=key)
        _expect_dims(self.memory, 3, "memory", "(layers, memory tokens, width)")
        _expect_dims(self.cls_token, 1, "cls_token", "(width,)")
        _expect_dims(self.head_weight, 2, "head_weight", "(classes, width)")
        _expect_dims(self.head_bias, 1, "head_bias", "(classes,)")
        width = self.cls_token.shape[0]
        if self.memory.shape[2] != width:
            raise AdapterShapeError(
                f"memory has width {self.memory.shape[2]} but cls_token has width {width}", field="memory"
            )
        if self.head_weight.shape[1] != width:
            raise AdapterShapeError(
                f"head weight reads width {self.head_weight.shape[1]} but cls_token has width {width}",
                field="head_weight",
            )
        if self.head_bias.shape[0] != self.head_weight.shape[0]:
            raise AdapterShapeError(
                f"head bias has {self.head_bias.shape[0]} rows "
                f"but head weight has {self.head_weight.shape[0]}",
                field="head_bias",
            )
        if self.labels is not None and len(self.labels) != self.num_classes:
            raise AdapterShapeError(
                f"{len(self.labels)} labels for a head of {self.num_classes} classes", field="labels"
            )

    @property
    def depth(self) -> int:
        return self.memory.shape[0]

    @property
    def width(self) -> int:
        return self.cls_token.shape[0]

    @property
    def num_memory(self) -> int:
        return self.memory.shape[1]

    @property
    def num_classes(self) -> int:
        return self.head_weight.shape[0]

    def check_fits(self, spec: ViTSpec) -> None:
        """Raise ``AdapterShapeError`` unless this adapter has the base's depth and width."""
        if self.depth != spec.depth:
            raise AdapterShapeError(
                f"adapter {self.name!r} has memory for {self.depth} layers but the base "
                f"{spec.arch} has {spec.depth}",
                field="memory",
            )
        if self.width != spec.width:
            raise AdapterShapeError(
                f"adapter {self.name!r} has width {self.width} "
                f"but the base {spec.arch} has width {spec.width}",
                field="cls_token",
            )

    @classmethod
    def initialise(
        cls,
        name: str,
        spec: ViTSpec,
        *,
        num_memory: int,
        num_classes: int,
        cls_token: Tensor | None = None,
        memory_norm: MemoryNorm = "norm1",
        parent: str | None = None,
        labels: tuple[str, ...] | None = None,
        generator: torch.Generator | None = None,
    ) -> AdapterWeights:
        """A fresh adapter as the paper starts one: memory ~ N(0, 0.02), class token copied from the
        base's (zeros if not given), a zero-initialised head."""
        if num_memory < 0 or num_classes < 1:
            raise AdapterShapeError("need num_memory >= 0 and num_classes >= 1")
        memory = torch.randn(spec.depth, num_memory, spec.width, generator=generator) * MEMORY_INIT_STD
        token = (
            torch.zeros(spec.width) if cls_token is None else cls_token.detach().float().reshape(-1).clone()
        )
        return cls(
            name=name,
            memory=memory,
            cls_token=token,
            head_weight=torch.zeros(num_classes, spec.width),
            head_bias=torch.zeros(num_classes),
            memory_norm=memory_norm,
            parent=parent,
            labels=labels,
        )


def _expect_dims(t: Tensor, ndim: int, key: str, layout: str) -> None:
    if t.ndim != ndim:
        raise AdapterShapeError(f"{key} must be {ndim}-D {layout}, got shape {tuple(t.shape)}", field=key)
