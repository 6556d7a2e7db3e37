"""Checkpoints of a training run: every adapter's parameters, optimiser and schedule, and the step.

A checkpoint is written atomically and names the base weights and each adapter's settings, so a
resumed run is the run that was interrupted or nothing: other base weights, other settings or
another set of adapters are refused with what differs.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import torch

from memvit.memory_core import MemoryViT

from ..files import write_atomic
from .config import CACHE_FIELDS, RUNTIME_FIELDS, TrainConfig, TrainingError
from .variant import Variant

CHECKPOINT_VERSION = 2  # 2: several adapters per run


def write_checkpoint(path: str | Path, engine: MemoryViT, variants: list[Variant], step: int) -> None:
    state = {
        "version": CHECKPOINT_VERSION,
        "base_fingerprint": engine.fingerprint,
        "configs": [config_key(v.config) for v in variants],
        "step": step,
        "variants": [v.state() for v in variants],
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())


def read_checkpoint(path: str | Path, engine: MemoryViT, variants: list[Variant]) -> int:
    """Restore ``variants`` from ``path``; returns the step it was written at."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as exc:
        raise TrainingError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise TrainingError(f"{path}: unknown checkpoint version {version}; start afresh")
    if state["base_fingerprint"] != engine.fingerprint:
        raise TrainingError(f"{path} was written for other base weights")
    saved = state["configs"]
    if [c["name"] for c in saved] != [v.name for v in variants]:
        raise TrainingError(
            f"{path} holds adapters {[c['name'] for c in saved]}, "
            f"this run trains {[v.name for v in variants]}"
        )
    for old, variant in zip(saved, variants, strict=True):
        new = config_key(variant.config)
        if old != new:
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise TrainingError(
                f"{path} was written with different settings ({', '.join(changed)}); start afresh"
            )
    for variant, variant_state in zip(variants, state["variants"], strict=True):
        variant.load_state(variant_state)
    return int(state["step"])


def config_key(config: TrainConfig) -> dict[str, Any]:
    """Everything that shapes the run; the workers, the eval batch size, the device, where a cache
    lives and is read from do not change the result (whether there is one does: it decides the
    augmentation), so a run may resume on another device. A run in float32 keys as runs did before
    precisions existed."""
    key = dataclasses.asdict(config)
    for k in (*RUNTIME_FIELDS, "extra"):
        key.pop(k)
    if key["precision"] == "float32":
        key.pop("precision")
    key["crop_scale"] = list(key["crop_scale"])
    if config.cache is None:  # an uncached run keys as it did before caches existed
        for k in CACHE_FIELDS:
            key.pop(k)
    else:
        key["cache"] = True
    return key
