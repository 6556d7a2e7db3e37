"""Image-classification folders: ``root/<class>/*.jpg|png|...``, scanned and checked up front.

A bad folder fails before any training starts, with a message that names the problem: missing,
empty, a single class, a class without images, or files that are not readable images. Every sample's
augmentation is seeded from (seed, epoch, index), so a run is reproducible and a resumed run sees
exactly the images and crops an uninterrupted one would have.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from memvit.memory_core import MemvitError

from ..preprocess import load_rgb

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}


class DataError(MemvitError):
    """A training or validation folder cannot be used."""


@dataclass(frozen=True)
class Samples:
    """Image paths with integer labels, and the class names the labels index."""

    root: Path
    classes: tuple[str, ...]
    paths: tuple[Path, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.paths)

    def subset(self, indices: list[int]) -> Samples:
        return Samples(
            self.root,
            self.classes,
            tuple(self.paths[i] for i in indices),
            tuple(self.labels[i] for i in indices),
        )

    def per_class(self) -> dict[str, int]:
        counts = dict.fromkeys(self.classes, 0)
        for label in self.labels:
            counts[self.classes[label]] += 1
        return counts


def scan_folder(
    root: str | Path, *, classes: tuple[str, ...] | None = None, check_images: bool = True
) -> Samples:
    """All images under ``root/<class>/``. ``classes`` pins the label order (e.g. a training set's)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"{root} has no class folders; expected {root}/<class>/<image files>")
    if classes is None:
        classes = tuple(found)
        if len(classes) < 2:
            raise DataError(f"{root} has only one class ({classes[0]!r}); a classifier needs at least two")
    else:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise DataError(f"{root} has classes {unknown} that the training set does not have")
    paths: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = root / name
        files = (
            sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            if folder.is_dir()
            else []
        )
        if not files and folder.is_dir():
            raise DataError(f"class folder {folder} has no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        paths += files
        labels += [label] * len(files)
    if not paths:
        raise DataError(f"{root} has no images")
    if check_images:
        _check_readable(paths)
    return Samples(root, tuple(classes), tuple(paths), tuple(labels))


def _check_readable(paths: list[Path]) -> None:
    # Opening reads only the header: cheap enough for tens of thousands of files, and it catches
    # files that are not images at all. Damage further in is reported, with the path, when decoded.
    bad = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.size  # noqa: B018
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            bad.append(f"{path} ({exc.__class__.__name__})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise DataError(f"{len(bad)} unreadable image(s): {'; '.join(bad[:5])}{more}")


def split(samples: Samples, fraction: float, seed: int) -> tuple[Samples, Samples]:
    """A seeded random (train, validation) split that keeps every class in both parts."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"validation fraction must be between 0 and 1, got {fraction}")
    rng = random.Random(seed)
    train, val = [], []
    for label in range(len(samples.classes)):
        idx = [i for i, y in enumerate(samples.labels) if y == label]
        rng.shuffle(idx)
        n_val = max(1, round(len(idx) * fraction)) if len(idx) > 1 else 0
        val += idx[:n_val]
        train += idx[n_val:]
    if not val:
        raise DataError(f"{samples.root}: too few images to hold out a validation split")
    return samples.subset(sorted(train)), samples.subset(sorted(val))


def load_image(path: Path, *, shrink_to: int | None = None) -> Image.Image:
    """One file -> upright RGB (``load_rgb``; ``shrink_to`` for the fast decode)."""
    try:
        with Image.open(path) as image:
            return load_rgb(image, shrink_to=shrink_to)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise DataError(f"cannot decode {path}: {exc}") from exc


class ImageDataset(Dataset):
    """``Samples`` through a transform; index ``epoch * len + i`` is sample i, augmented for that epoch."""

    def __init__(
        self,
        samples: Samples,
        transform: Callable[[Image.Image], Tensor],
        seed: int = 0,
        *,
        shrink_to: int | None = None,
    ) -> None:
        self.samples = samples
        self.transform = transform
        self.seed = seed
        self.shrink_to = shrink_to  # the fast decode (memvit.adapters.preprocess.decode_target)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        i = index % len(self.samples)
        image = load_image(self.samples.paths[i], shrink_to=self.shrink_to)
        # timm's and torchvision's transforms draw from the global RNGs: seed them per sample and
        # epoch, and put them back afterwards so that nothing else in the process is disturbed.
        sample_seed = hash((self.seed, index)) & 0x7FFFFFFF
        py_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            tensor = self.transform(image)
        random.setstate(py_state)
        return tensor, self.samples.labels[i]


class StreamSampler(Sampler[int]):
    """Indices for ``num_items`` draws, epoch after epoch of seeded permutations, from ``start`` on.

    Epoch e yields ``e * n + perm_e[j]``, so the dataset knows the epoch of every draw. Starting at
    ``start`` skips what a resumed run has already seen without loading any of it.
    """

    def __init__(self, n: int, seed: int, num_items: int, start: int = 0) -> None:
        self.n, self.seed, self.num_items, self.start = n, seed, num_items, start

    def __len__(self) -> int:
        return max(0, self.num_items - self.start)

    def __iter__(self) -> Iterator[int]:
        position = self.start
        while position < self.num_items:
            epoch, offset = divmod(position, self.n)
            perm = torch.randperm(
                self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            )
            for j in perm[offset : offset + self.num_items - position].tolist():
                yield epoch * self.n + j
                position += 1
