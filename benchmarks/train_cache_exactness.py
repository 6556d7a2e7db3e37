"""Step 4 of benchmarks/train_cache.py: an adapter trained from a cache, on held-out images, its
logits from float32, float16 and bfloat16 caches against the uncached passes and a float64 engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import deit_tiny_engine
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainingRun, scan_folder
from memvit.adapters.training.cache import ActivationCache
from memvit.adapters.training.cache_key import CacheSpec
from memvit.adapters.training.data import ImageDataset
from memvit.memory_core import AdapterWeights, MemoryViT


def print_exactness(engine: MemoryViT, run: TrainingRun, val: Path, root: Path) -> None:
    weights = run.variants[0].adapter.weights()
    adapter_set = engine.prepare_set([weights])
    samples = scan_folder(val, check_images=False)
    labels = torch.tensor(samples.labels)
    loader = torch.utils.data.DataLoader(ImageDataset(samples, eval_transform(engine)), batch_size=64)
    uncached: dict[str, list[torch.Tensor]] = {"split": [], "merged": []}
    with torch.inference_mode():
        for x, _ in loader:
            for path, logits in uncached.items():  # split: the pass it trained with; merged: served
                logits.append(engine(x, adapter_set, path=path).adapters[weights.name])
    split, merged = (torch.cat(uncached[path]) for path in ("split", "merged"))
    exact = float64_logits(weights, loader)
    top1 = (split.argmax(-1) == labels).float().mean().item()
    print(
        f"\nThe adapter trained above (memory 1, {run.steps} steps from the float16 cache) on "
        f"{len(samples)} held-out CIFAR-10 test images (logits {split.min():.1f} to {split.max():.1f}):"
    )
    print("| logits from | max abs diff vs split path | vs served (merged) | vs float64 | top-1 | change |")
    print("|---|--:|--:|--:|--:|--:|")
    to_merged, to_exact = (split - merged).abs().max(), (split.double() - exact).abs().max()
    print(f"| the images, split path | 0 | {to_merged:.2e} | {to_exact:.2e} | {top1:.4f} | - |")
    stores = (
        ("inputs", "float32"),
        ("keys-values", "float32"),
        ("inputs", "float16"),
        ("inputs", "bfloat16"),
    )
    for store, dtype in stores:
        spec = CacheSpec(root / f"exact-{store}-{dtype}", dtype, store, 1)
        cache = ActivationCache.open_or_build(spec, engine, samples, progress=False)
        with torch.inference_mode():
            rows = [range(s, min(s + 64, len(cache))) for s in range(0, len(cache), 64)]
            cached = torch.cat([engine(cache.batch(r), adapter_set).adapters[weights.name] for r in rows])
        acc = (cached.argmax(-1) == labels).float().mean().item()
        to_split, to_merged = (cached - split).abs().max(), (cached - merged).abs().max()
        to_exact = (cached.double() - exact).abs().max()
        print(
            f"| cache: {store}, {dtype} | {to_split:.2e} | {to_merged:.2e} | {to_exact:.2e} | {acc:.4f} "
            f"| {acc - top1:+.4f} |"
        )


def float64_logits(weights: AdapterWeights, loader: torch.utils.data.DataLoader) -> torch.Tensor:
    """The adapter's logits from a float64 engine on the same weights: how far float32 itself is from
    the exact numbers, the scale against which the cache's differences are read."""
    engine = deit_tiny_engine().double()
    tensors = ("memory", "cls_token", "head_weight", "head_bias")
    adapter_set = engine.prepare_set([replace(weights, **{k: getattr(weights, k).double() for k in tensors})])
    with torch.inference_mode():
        return torch.cat(
            [engine(x.double(), adapter_set, path="split").adapters[weights.name] for x, _ in loader]
        )
