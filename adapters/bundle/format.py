"""The adapter bundle ``memvit.adapter/1``: one safetensors file per adapter (docs/design.md §3).

    tensors   memory (L, m, D) | cls_token (D,) | head.weight (C, D) | head.bias (C,)
    metadata  format, name, base_model, base_fingerprint, memory_norm, labels (JSON list),
              parent (optional), training (optional JSON object)

``AdapterBundle`` pairs the engine-level ``AdapterWeights`` with what ties it to one base. Reading
and strict validation are in ``reader.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save

from memvit.memory_core import AdapterWeights, MemoryViT

from ..files import write_atomic

FORMAT = "memvit.adapter/1"
TENSOR_LAYOUT: dict[str, str] = {
    "memory": "(L, m, D)",
    "cls_token": "(D,)",
    "head.weight": "(C, D)",
    "head.bias": "(C,)",
}
# The bundle's tensor names -> AdapterWeights attributes: the one place the two namings meet.
TENSOR_FIELDS: dict[str, str] = {
    "memory": "memory",
    "cls_token": "cls_token",
    "head.weight": "head_weight",
    "head.bias": "head_bias",
}
REQUIRED_METADATA = ("format", "name", "base_model", "base_fingerprint", "memory_norm", "labels")
OPTIONAL_METADATA = ("parent", "training")


@dataclass(frozen=True, eq=False)
class AdapterBundle:
    """An adapter and the base it was trained on."""

    weights: AdapterWeights
    base_model: str  # timm architecture, e.g. "vit_base_patch32_224"
    base_fingerprint: str  # memory_core.state_fingerprint of the base weights
    training: dict[str, Any] | None = None  # data, steps, hyper-parameters, accuracy

    @property
    def name(self) -> str:
        return self.weights.name

    @property
    def labels(self) -> tuple[str, ...]:
        w = self.weights
        return w.labels if w.labels is not None else tuple(f"class_{i}" for i in range(w.num_classes))

    def metadata(self) -> dict[str, str]:
        w = self.weights
        meta = {
            "format": FORMAT,
            "name": w.name,
            "base_model": self.base_model,
            "base_fingerprint": self.base_fingerprint,
            "memory_norm": w.memory_norm,
            "labels": json.dumps(list(self.labels)),
        }
        if w.parent is not None:
            meta["parent"] = w.parent
        if self.training is not None:
            meta["training"] = json.dumps(self.training, sort_keys=True)
        return meta

    def tensors(self) -> dict[str, Any]:
        return {
            name: getattr(self.weights, attr).detach().float().contiguous()
            for name, attr in TENSOR_FIELDS.items()
        }

    def to_bytes(self) -> bytes:
        return save({k: v.cpu() for k, v in self.tensors().items()}, metadata=self.metadata())

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``memvit inspect`` and the service show)."""
        w = self.weights
        return {
            "name": w.name,
            "parent": w.parent,
            "base_model": self.base_model,
            "base_fingerprint": self.base_fingerprint,
            "memory_norm": w.memory_norm,
            "memory_tokens": w.num_memory,
            "layers": w.depth,
            "width": w.width,
            "num_classes": w.num_classes,
            "labels": list(self.labels),
            "training": self.training,
        }


def bundle_for(
    weights: AdapterWeights, engine: MemoryViT, training: dict[str, Any] | None = None
) -> AdapterBundle:
    """Tie ``weights`` to the base ``engine`` serves (its architecture and fingerprint)."""
    weights.check_fits(engine.spec)
    return AdapterBundle(
        weights=weights,
        base_model=engine.spec.arch,
        base_fingerprint=engine.fingerprint,
        training=training,
    )


def save_bundle(bundle: AdapterBundle, path: str | Path) -> Path:
    """Write ``bundle`` to ``path`` atomically."""
    return write_atomic(path, bundle.to_bytes())
