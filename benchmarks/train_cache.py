"""Training from an activation cache against training from the images: epoch time, bytes, exactness.

    python -m benchmarks.train_cache       # DeiT-Tiny, 1,020 CIFAR-10 images, ~15 minutes on 2 CPU cores

On the real DeiT-Tiny (frozen) and a CIFAR-10 subset (``--images``, upscaled to 224 as the base reads
it), with ``TrainingRun`` as ``memvit train`` runs it (batch 32, the threads torch has):
1. Builds the activation caches: float16, "inputs" (normed layer inputs) with the original and the
   mirrored view, "keys-values" with the original (every epoch reads one view per image either way).
2. Times epochs in interleaved rounds, for 1 adapter and for 8 (a sweep's variants): one whole epoch
   from each cache, in RAM (its pages resident) and from disk (its pages dropped from memory before
   the epoch; ``mincore`` says how many stayed), and a few steps from the images (decode,
   random-resized crop and flip, the base and the class-token path), whose epoch is its steps times
   the round's step time (a whole one takes 20-40 s here, and its steps are alike). Each round also
   times one batch of a cache build. Rounds take seconds, so a ratio compares timings taken close
   together on this shared machine; ratios are medians of per-round ratios.
3. Projects "8 variants x 20,000 images x 20 epochs" from the measured rates: the cache build, 20
   epochs streamed from disk (36 GB of float16 views do not fit in 24 GiB) and 9 validation passes
   (a sweep's curve points and its final score) over 2,000 held-out images.
4. Exactness: the adapter trained above, on held-out images: its logits from float32, float16 and
   bfloat16 caches against the uncached passes (max abs difference), and top-1 from each.
"""

from __future__ import annotations

import math
import mmap
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import CIFAR10, argument_parser, deit_tiny_engine, environment, pin_malloc
from benchmarks.datasets import cifar_tar_to_folder
from benchmarks.train_cache_exactness import print_exactness
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training import TrainConfig, TrainingRun, evaluate_many
from memvit.adapters.training.cache import ActivationCache
from memvit.adapters.training.cache_key import CacheSpec
from memvit.adapters.training.data import ImageDataset
from memvit.adapters.training.residency import resident_pages
from memvit.memory_core import MemoryViT
from memvit.memory_core.stored.cached import capture

TRAIN_TAR = CIFAR10 / "cifar10_jpg_train_50k.tar.gz"
TEST_TAR = CIFAR10 / "cifar10_jpg_test_10k.tar.gz"


def resident(cache: ActivationCache) -> float:
    """Fraction of the cache's activation pages in memory now (``mincore``)."""
    array = cache.activations
    pages = resident_pages(array.ctypes.data, array.nbytes)
    return float("nan") if pages is None else sum(b & 1 for b in pages) / len(pages)


def drop_from_memory(caches: list[ActivationCache]) -> None:
    """Unmap a cache file's pages from every mapping of it here and drop them from the page cache: the
    next reads come from disk, as when streaming a cache larger than memory."""
    for cache in caches:
        cache.mapping.madvise(mmap.MADV_DONTNEED)
    fd = os.open(caches[0].directory / "activations.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(cache: ActivationCache) -> None:
    """Touch every page once, so the epoch after finds the whole cache in memory."""
    np.asarray(cache.activations).reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].sum()


def data(root: Path, per_class: int, val_per_class: int) -> tuple[Path, Path]:
    train, val = root / f"train-{per_class}", root / f"test-{val_per_class}"
    if not train.is_dir():
        cifar_tar_to_folder(TRAIN_TAR, train, per_class=per_class)
    if not val.is_dir():
        cifar_tar_to_folder(TEST_TAR, val, per_class=val_per_class)
    return train, val


def configs(k: int, train: Path, val: Path, epochs: int, spec: CacheSpec | None = None) -> list[TrainConfig]:
    """A sweep's variants (learning rates and memory sizes differ, the data is shared), from the images
    or from the cache ``spec`` describes."""
    cache = {}
    if spec is not None:
        cache = {"cache": str(spec.directory), "cache_dtype": spec.dtype, "cache_store": spec.store}
        cache["cache_views"] = spec.views
    return [
        TrainConfig(
            name=f"v{i}",
            train_dir=str(train),
            val_dir=str(val),
            epochs=epochs,
            batch_size=32,
            lr=0.02 * (i + 1),
            memory_tokens=(1, 5)[i % 2],
            memory_init="normal",
            **cache,
        )
        for i in range(k)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--images", type=int, default=1024, help="training images (CIFAR-10, per class / 10)")
    parser.add_argument("--val-images", type=int, default=500, help="held-out images (CIFAR-10 test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/memvit-train-cache"))
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    load_at_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    torch.manual_seed(0)
    train, val = data(args.dir, args.images // 10, args.val_images // 10)
    engine = deit_tiny_engine()
    # float16; the mirrored view only where the comparison trains from it (both read one view per epoch)
    specs = {
        "inputs": CacheSpec(args.dir / "cache-inputs", "float16", "inputs", 2),
        "keys-values": CacheSpec(args.dir / "cache-keys-values", "float16", "keys-values", 1),
    }
    for spec in specs.values():  # build the caches (timed below, one batch per round)
        run = TrainingRun(engine, configs(1, train, val, 1, spec), progress=False)
    n = len(run.train_samples)

    # One run per (adapters, source). Each round: a build batch (decode, eval transform, the base),
    # a few steps from the images per K (a whole epoch from the images takes 20-40 s here and its
    # steps are alike, so its time is steps x the round's median step), then one whole epoch from
    # each cache. Rounds are short, so every ratio compares timings taken within seconds of each other.
    per_epoch = math.ceil(n / 32)
    image_steps = 3
    runs: dict[str, TrainingRun] = {}
    for k in (1, args.variants):
        epochs = math.ceil(image_steps * (args.rounds + 1) / per_epoch)
        runs[f"images K={k}"] = TrainingRun(engine, configs(k, train, val, epochs), progress=False)
        for store, spec in specs.items():
            for where in ("RAM", "disk"):
                run = TrainingRun(engine, configs(k, train, val, args.rounds + 1, spec), progress=False)
                runs[f"{store} {where} K={k}"] = run
    builder = _build_batch(engine, run.train_samples)
    times: dict[str, list[float]] = {name: [] for name in [*runs, "build"]}
    residency: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
        started = time.perf_counter()
        builder()
        seconds = {"build": time.perf_counter() - started}
        for name, run in runs.items():
            if run.train_cache is not None:
                if " disk " in name:  # every mapping of the file lets go of its pages, then the kernel
                    cache = run.train_cache
                    drop_from_memory(
                        [
                            r.train_cache
                            for r in runs.values()
                            if r.train_cache and r.train_cache.directory == cache.directory
                        ]
                    )
                else:
                    warm(run.train_cache)
                residency[name].append(resident(run.train_cache))
            steps = image_steps if run.train_cache is None else per_epoch
            started = time.perf_counter()
            run.run(until=run.steps + steps)
            seconds[name] = (time.perf_counter() - started) * per_epoch / steps  # one epoch's worth
        if round_:
            for name, value in seconds.items():
                times[name].append(value)
    load = f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    details = (f"{n} CIFAR-10 images", "batch 32", f"{args.rounds} rounds", malloc, load)
    print(environment("deit_tiny_patch16_224", *details))
    _print_epochs(times, residency, n, args.variants, specs)
    many = runs[f"inputs RAM K={args.variants}"]
    _print_projection(times, n, many, engine)
    print_exactness(engine, runs["inputs RAM K=1"], val, args.dir)


def _print_epochs(times: dict, residency: dict, n: int, many: int, specs: dict) -> None:
    print(
        "\n| adapters | epoch from | s / epoch | images/s | speed-up vs images | per round (min-max) "
        "| resident before the epoch |"
    )
    print("|--:|---|--:|--:|--:|--:|--:|")
    for k in (1, many):
        base = f"images K={k}"
        for name in [base, *(f"{s} {where} K={k}" for s in specs for where in ("RAM", "disk"))]:
            ratios = [tb / t for tb, t in zip(times[base], times[name], strict=True)]
            res = residency[name][1:]
            seen = "-" if not res else f"{min(res):.0%}-{max(res):.0%}"
            spread = f"{min(ratios):.1f}-{max(ratios):.1f}" if name != base else "-"
            source = name.rsplit(" K=", 1)[0]
            seconds = statistics.median(times[name])
            print(
                f"| {k} | {source} | {seconds:.2f} | {n / seconds:.0f} | {statistics.median(ratios):.1f}x "
                f"| {spread} | {seen} |"
            )
    for store, spec in specs.items():
        cache = ActivationCache.open(spec.part("train").directory)
        per_view, logits = cache.activations[0, 0].nbytes, cache.base_logits[0, 0].nbytes
        print(
            f"{store}: {per_view:,} bytes per image and view ({spec.dtype}), plus {logits:,} of base logits"
        )


def _build_batch(engine: MemoryViT, samples) -> Callable[[], None]:
    """One batch of a cache build: 32 images decoded, through the eval transform and the base."""
    dataset = ImageDataset(samples.subset(list(range(32))), eval_transform(engine))

    def build() -> None:
        x = torch.stack([dataset[i][0] for i in range(len(dataset))])
        capture(engine, x, "inputs")

    return build


def _print_projection(times: dict, n: int, run: TrainingRun, engine: MemoryViT) -> None:
    build_rate = 32 / statistics.median(times["build"])  # one batch of 32 images per round
    k = len(run.variants)
    train_rate = n / statistics.median(times[f"inputs disk K={k}"])
    weights = [v.adapter.weights() for v in run.variants]
    started = time.perf_counter()
    evaluate_many(
        engine, weights, run.val_samples, eval_transform(engine), batch_size=64, cache=run.val_cache
    )
    eval_rate = len(run.val_samples) / (time.perf_counter() - started)
    images, epochs, val_images, val_passes = 20_000, 20, 2_000, 9
    parts = {
        "cache build (20,000 images x 2 views, 2,000 validation images)": (2 * images + val_images)
        / build_rate,
        f"{epochs} epochs of {k} variants, streamed from disk": images * epochs / train_rate,
        f"{val_passes} validation passes of {k} variants, from the cache": val_passes
        * val_images
        / eval_rate,
    }
    print(
        f"\nProjected: {k} variants x {images:,} images x {epochs} epochs, from the measured rates (build "
        f"{build_rate:.0f} base passes/s, training {train_rate:.0f} images/s from disk, validation "
        f"{eval_rate:.0f} images/s from the cache):"
    )
    for what, s in parts.items():
        print(f"- {what}: {s / 60:.1f} min")
    total = sum(parts.values())
    print(f"- total: {total / 60:.1f} min (target under 60 min: {'met' if total < 3600 else 'MISSED'})")


if __name__ == "__main__":
    main()
