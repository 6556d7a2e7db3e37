"""Building the frozen base ViT: from a local weights file, from timm's hub download, or random.

Weights files are read with timm's own loader (safetensors, or .pth/.pt with ``weights_only``), so
a checkpoint that loads into timm loads here. A safetensors file may describe itself in its
metadata: ``arch`` (the timm architecture), ``model_kwargs`` (JSON, e.g. a small image size),
``labels`` (JSON list of class names) and ``data_config`` (JSON: mean, std, interpolation, crop_pct
overriding timm's defaults for the architecture); then the file alone is enough to serve it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from ..errors import UnsupportedModelError, WeightsError
from .spec import check_supported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseModel:
    """A timm ViT ready to host adapters, with what is known about it."""

    model: VisionTransformer
    arch: str
    labels: tuple[str, ...] | None = None
    source: str = "random"  # the weights file, "timm-pretrained" or "random"
    data_config: dict[str, Any] | None = None  # preprocessing overrides (mean, std, interpolation, crop_pct)


def save_base(
    model: torch.nn.Module,
    path: str | Path,
    *,
    arch: str,
    model_kwargs: dict[str, Any] | None = None,
    labels: tuple[str, ...] | list[str] | None = None,
    data_config: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    """Write ``model``'s weights as a self-describing safetensors file that ``create_base`` reads alone.

    ``extra`` adds free-form string metadata (provenance, accuracy); the reserved keys win over it.
    """
    check_supported(model)
    meta = dict(extra or {})
    meta["arch"] = arch
    if model_kwargs:
        meta["model_kwargs"] = json.dumps(model_kwargs)
    if labels is not None:
        meta["labels"] = json.dumps(list(labels))
    if data_config:
        meta["data_config"] = json.dumps(data_config)
    path = Path(path)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(path), metadata=meta)
    return path


def read_weights_metadata(path: str | Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file ({} for other formats or none)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for every malformed file
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from exc


def create_base(
    arch: str | None = None,
    *,
    weights: str | Path | None = None,
    pretrained: bool = False,
    labels: tuple[str, ...] | None = None,
    data_config: dict[str, Any] | None = None,
    **model_kwargs: Any,
) -> BaseModel:
    """Build a supported timm ViT.

    - ``weights``: a local .safetensors/.pth file; the head size is taken from the file.
    - ``pretrained``: timm's own download (needs a network; never used by the tests).
    - neither: random initialisation (tests and benchmarks).
    """
    meta: dict[str, str] = {}
    if weights is not None:
        weights = Path(weights)
        if not weights.is_file():
            raise WeightsError(f"weights file not found: {weights}")
        meta = read_weights_metadata(weights)
        arch = arch or meta.get("arch")
        model_kwargs = {**_json(meta, "model_kwargs", weights, {}), **model_kwargs}
        if labels is None and "labels" in meta:
            labels = tuple(_json(meta, "labels", weights, []))
        data_config = {**_json(meta, "data_config", weights, {}), **(data_config or {})}
    if not arch:
        raise WeightsError("no architecture given and the weights file does not name one (metadata 'arch')")

    state = _read_state(weights) if weights is not None else None
    if state is not None and "num_classes" not in model_kwargs and "head.weight" in state:
        model_kwargs["num_classes"] = state["head.weight"].shape[0]
    if labels is not None and "num_classes" not in model_kwargs:
        model_kwargs["num_classes"] = len(labels)

    model = _create(arch, pretrained=pretrained and weights is None, **model_kwargs)
    check_supported(model)  # fail before spending time on weights
    if state is not None:
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[:4]
            raise WeightsError(
                f"{weights} does not fit {arch}: {' '.join(s.strip() for s in first)}"
            ) from exc
    if labels is not None and len(labels) != model.num_classes:
        raise WeightsError(f"{len(labels)} labels given for a head of {model.num_classes} classes")
    model.eval().requires_grad_(False)
    source = str(weights) if weights is not None else ("timm-pretrained" if pretrained else "random")
    log.info("base %s loaded from %s", arch, source)
    return BaseModel(model=model, arch=arch, labels=labels, source=source, data_config=data_config or None)


def _create(arch: str, *, pretrained: bool, **kwargs: Any) -> VisionTransformer:
    if not timm.is_model(arch):
        raise UnsupportedModelError(f"unknown timm architecture {arch!r}")
    try:
        return timm.create_model(arch, pretrained=pretrained, **kwargs)
    except TypeError as exc:
        raise UnsupportedModelError(f"cannot build {arch} with {kwargs}: {exc}") from exc


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        return timm.models.load_state_dict(str(path), use_ema=True)
    except Exception as exc:  # corrupt files raise anything from SafetensorError to UnpicklingError
        raise WeightsError(f"{path}: cannot read weights ({type(exc).__name__}: {exc})") from exc


def _json(meta: dict[str, str], key: str, path: Path, default: Any) -> Any:
    if key not in meta:
        return default
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{path}: metadata {key!r} is not valid JSON") from exc
