"""What an activation cache must match to serve: its key, checked with a message that says what changed.

The key (``cache_key``) is everything a cache's numbers depend on: the base's fingerprint and the
engine's dtype, the exact preprocessing (timm data config and decode mode), the images (relative
paths, sizes, mtimes and labels, hashed), the views, the storage dtype and store, the format.
``check_key`` refuses any difference, naming it and how to rebuild (docs/design.md §2.9).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import STORES

from .data import DataError, Samples

FORMAT = "memvit.activation-cache/1"
VIEWS = ("original", "hflip")  # a cache holds the first 1 or 2 of these per image
# Storage dtypes, as numpy maps them (bfloat16 has no numpy dtype: its bits are kept as uint16).
DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}


class CacheError(DataError):
    """An activation cache cannot be used or built as asked."""


@dataclass(frozen=True)
class CacheSpec:
    """How to cache: where, in what dtype and store, how many views, and whether to rebuild."""

    directory: Path
    dtype: str = "float16"
    store: str = "inputs"
    views: int = 2
    rebuild: bool = False
    precision: str = "float32"  # of the base's pass that builds it (device.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CacheError(f"cache dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.store not in STORES:
            raise CacheError(f"cache store must be one of {', '.join(STORES)}, got {self.store!r}")
        if self.views not in (1, 2):
            raise CacheError(f"cache views must be 1 (original) or 2 (original and hflip), got {self.views}")

    def part(self, name: str, *, views: int | None = None) -> CacheSpec:
        """The same settings for one image set under this directory (e.g. "train", "val")."""
        return CacheSpec(
            self.directory / name, self.dtype, self.store, views or self.views, self.rebuild, self.precision
        )


def cache_key(engine: MemoryViT, samples: Samples, spec: CacheSpec, decode: str) -> dict[str, Any]:
    """Everything a cache's numbers depend on; a cache serves only a request with an equal key."""
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in engine.data_config().items()}
    # The base's pass in another precision computes other numbers; float32 keys as before precisions.
    # ``base``: that pass runs the base held in the precision's dtype, its norms too (mixed_pass.held_in);
    # caches built under autocast over the float32 weights, or with the norms' scales in float32,
    # hold other numbers and are refused.
    precision = {}
    if spec.precision != "float32":
        precision = {"precision": spec.precision, "base": f"held in {spec.precision}, norms too"}
    return {
        "format": FORMAT,
        "base_model": engine.spec.arch,
        "base_fingerprint": engine.fingerprint,
        "engine_dtype": str(engine.dtype).removeprefix("torch."),
        "preprocessing": {"transform": "eval", "decode": decode, **config},
        "dataset": _dataset_hash(files(samples), samples.classes),
        "images": len(samples),
        "views": list(VIEWS[: spec.views]),
        "dtype": spec.dtype,
        "store": spec.store,
        **precision,
    }


def files(samples: Samples) -> list[list[Any]]:
    """[path relative to the root, size, mtime in ns, label] per image: what identifies the images
    (a folder moved elsewhere keeps its caches)."""
    rows = []
    for path, label in zip(samples.paths, samples.labels, strict=True):
        stat = path.stat()
        rows.append([str(path.relative_to(samples.root)), stat.st_size, stat.st_mtime_ns, label])
    return rows


def _dataset_hash(files: list[list[Any]], classes: tuple[str, ...]) -> str:
    text = json.dumps({"classes": list(classes), "files": files}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    if not path.is_file():
        raise CacheError(
            f"{directory} is not a complete activation cache (no manifest.json): remove it, or rebuild "
            "it with --rebuild-cache"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: unreadable ({exc}); rebuild it with --rebuild-cache") from None
    if manifest.get("key", {}).get("format") != FORMAT or not manifest.get("complete"):
        raise CacheError(f"{directory} is not a complete {FORMAT} cache; rebuild it with --rebuild-cache")
    return manifest


_WHAT = {
    "base_model": "the base model",
    "base_fingerprint": "the base weights",
    "engine_dtype": "the engine's dtype",
    "preprocessing": "the preprocessing",
    "dataset": "the images",
    "images": "the number of images",
    "views": "the views",
    "dtype": "the storage dtype",
    "store": "the store",
    "precision": "the precision of the base's pass",
    "base": "how that pass held the base",
}


def check_key(directory: Path, manifest: dict[str, Any], key: dict[str, Any], samples: Samples) -> None:
    old = manifest["key"]
    if "precision" in old or "precision" in key:  # absent: float32
        old, key = {"precision": "float32", **old}, {"precision": "float32", **key}
    changed = [k for k in key if old.get(k) != key[k]]
    if not changed:
        return
    details = []
    for k in changed:
        if k == "dataset":
            details.append(f"the images ({_dataset_change(directory, samples)})")
        elif k == "preprocessing":
            diff = sorted(f for f in set(old[k]) | set(key[k]) if old[k].get(f) != key[k].get(f))
            details.append(
                f"the preprocessing ({', '.join(f'{f}: {old[k].get(f)} -> {key[k].get(f)}' for f in diff)})"
            )
        elif k == "base_fingerprint":
            details.append(f"the base weights (cached {old[k][:12]}..., now {key[k][:12]}...)")
        elif k != "images":
            details.append(f"{_WHAT[k]} (cached {old.get(k)}, asked {key[k]})")
    raise CacheError(
        f"activation cache {directory} was built for other inputs; changed: {'; '.join(details)}. "
        "Rebuild it with --rebuild-cache, or give another --cache directory"
    )


def _dataset_change(directory: Path, samples: Samples) -> str:
    """What differs between the cached image list and the folder now, in a few words."""
    try:
        then = json.loads((directory / "files.json").read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return "the cached list is unreadable"
    old = {f[0]: f for f in then}
    new = {f[0]: f for f in files(samples)}
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    modified = sorted(p for p in set(old) & set(new) if old[p] != new[p])
    parts = [f"{len(old)} cached, {len(new)} now"]
    for word, paths in (("added", added), ("removed", removed), ("changed", modified)):
        if paths:
            parts.append(f"{len(paths)} {word}, e.g. {paths[0]}")
    return "; ".join(parts) if len(parts) > 1 else "same files, other class names or order"
