"""One adapter's learned parameters: per-layer memory, a class token and a head.

``AdapterWeights`` is the in-memory form of a bundle (the file format lives in ``adapters/``) and the
one place where an adapter is validated: its name, parent, memory placement, labels, and tensors
that must fit each other and be finite are all checked when it is built, whatever built it (the
bundle reader, the trainer, a test). ``check_fits`` adds the checks that need the base model (depth
and width). Both run before anything is copied into a live adapter set; a new bundle format only
has to map its fields onto this class.
"""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..errors import AdapterShapeError, InvalidAdapterError
from .spec import ViTSpec

MemoryNorm = Literal["norm1", "none"]
MEMORY_NORMS: tuple[str, ...] = ("norm1", "none")

# Adapter names travel in URLs, file names and JSON keys; keep them boring.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# The base model's own task answers under this name, so no adapter may take it.
BASE_TASK = "base"

MEMORY_INIT_STD = 0.02  # the paper's N(0, 0.02) initialisation of memory tokens
# Every adapter parameter must lie within +-MAX_ABS_VALUE. Trained adapters stay far inside it (their
# values are of order 1), and it keeps every logit finite for finite images: a logit is
# head_weight . c + head_bias with c the final LayerNorm's output, so |logit| <= D * 1e4 * |c|_max + 1e4,
# about 1e9 for ViT-B (|c| ~ 100), far below float32's and bfloat16's 3.4e38; softmax of finite logits
# is finite. A head of 3e38 (finite, but overflowing the first product) is refused instead.
MAX_ABS_VALUE = 1e4

# (attribute, expected rank, layout) of every tensor, in the order they are checked.
TENSORS: tuple[tuple[str, int, str], ...] = (
    ("memory", 3, "(layers, memory tokens, width)"),
    ("cls_token", 1, "(width,)"),
    ("head_weight", 2, "(classes, width)"),
    ("head_bias", 1, "(classes,)"),
)


def check_name(name: object, *, field: str = "name") -> None:
    """Raise ``InvalidAdapterError`` unless ``name`` can name an adapter (URL-, file- and JSON-safe)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidAdapterError(
            f"invalid {field} {name!r}: use 1-64 characters from a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit",
            field=field,
        )
    if name == BASE_TASK:
        raise InvalidAdapterError(
            f"invalid {field} {name!r}: it is reserved for the base model's task", field=field
        )


def check_memory_norm(value: object) -> None:
    """Raise ``InvalidAdapterError`` unless ``value`` is a known memory placement (docs/design.md §1.2)."""
    if value not in MEMORY_NORMS:
        raise InvalidAdapterError(
            f"memory_norm must be one of {list(MEMORY_NORMS)}, got {value!r}", field="memory_norm"
        )


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
    # False only for a trainer's own live parameters, rebuilt every step: the NaN and range checks
    # read every tensor back (a sync each), and the bundle a training run writes is checked anyway.
    check_values: InitVar[bool] = True

    def __post_init__(self, check_values: bool) -> None:
        check_name(self.name)
        if self.parent is not None:
            check_name(self.parent, field="parent")
            if self.parent == self.name:
                raise InvalidAdapterError(f"adapter {self.name!r} names itself as its parent", field="parent")
        check_memory_norm(self.memory_norm)
        self._check_tensors(check_values)
        if self.labels is not None:
            if not isinstance(self.labels, tuple) or not all(isinstance(x, str) for x in self.labels):
                raise InvalidAdapterError("labels must be a tuple of strings", field="labels")
            if len(self.labels) != self.num_classes:
                raise InvalidAdapterError(
                    f"{len(self.labels)} labels for a head of {self.num_classes} classes "
                    f"(head_weight has {self.num_classes} rows)",
                    field="labels",
                )

    def _check_tensors(self, check_values: bool) -> None:
        for key, ndim, layout in TENSORS:
            t = getattr(self, key)
            if not isinstance(t, Tensor):
                raise AdapterShapeError(f"{key} must be a tensor, got {type(t).__name__}", field=key)
            if not t.is_floating_point():
                raise AdapterShapeError(f"{key} must be a floating-point tensor, got {t.dtype}", field=key)
            if t.ndim != ndim:
                raise AdapterShapeError(
                    f"{key} must be {ndim}-D {layout}, got shape {tuple(t.shape)}", field=key
                )
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
        if self.head_weight.shape[0] == 0:
            raise AdapterShapeError(
                "the head has 0 classes; an adapter needs at least one", field="head_weight"
            )
        if not check_values:
            return
        with torch.no_grad():
            for key, _, _ in TENSORS:
                t = getattr(self, key)
                if not torch.isfinite(t).all():
                    raise InvalidAdapterError(f"{key!r} contains NaN or inf", field=key)
                if t.numel() and (peak := t.abs().max().item()) > MAX_ABS_VALUE:
                    raise InvalidAdapterError(
                        f"{key!r} has values up to {peak:.3g}; adapter parameters must lie within "
                        f"+-{MAX_ABS_VALUE:g} so that logits stay finite",
                        field=key,
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

    @property
    def requires_grad(self) -> bool:
        """True while some tensor is being trained (``prepare`` then keeps the autograd graph)."""
        return any(getattr(self, key).requires_grad for key, _, _ in TENSORS)

    def check_fits(self, spec: ViTSpec) -> None:
        """Raise ``AdapterShapeError`` unless this adapter has the base's depth and width."""
        if self.depth != spec.depth:
            raise AdapterShapeError(
                f"adapter {self.name!r} has memory for {self.depth} layers, {spec.arch} has {spec.depth}",
                field="memory",
            )
        if self.width != spec.width:
            raise AdapterShapeError(
                f"adapter {self.name!r} has width {self.width}, {spec.arch} has width {spec.width}",
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
        """A fresh adapter as the paper starts one: memory ~ N(0, 0.02), the class token copied from
        ``cls_token`` (the base's; zeros if not given), a zero head (uniform predictions at step 0)."""
        if num_memory < 0 or num_classes < 1:
            raise AdapterShapeError(
                f"need num_memory >= 0 and num_classes >= 1, got {num_memory} and {num_classes}"
            )
        memory = torch.randn(spec.depth, num_memory, spec.width, generator=generator) * MEMORY_INIT_STD
        token = (
            torch.zeros(spec.width)
            if cls_token is None
            else cls_token.detach().float().reshape(-1).cpu().clone()
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
