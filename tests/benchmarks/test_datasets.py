"""Dataset sources become class folders deterministically."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile

import numpy as np
import pytest
from PIL import Image

from benchmarks.datasets import arrays_to_folder, cifar_tar_to_folder, fashion_mnist_split, read_idx
from memvit.adapters.training import scan_folder


def _idx(array: np.ndarray) -> bytes:
    return (
        struct.pack(">HBB", 0, 0x08, array.ndim)
        + struct.pack(">" + "I" * array.ndim, *array.shape)
        + array.tobytes()
    )


def test_idx_round_trip_plain_and_gzipped(tmp_path) -> None:
    images = np.arange(2 * 4 * 4, dtype=np.uint8).reshape(2, 4, 4)
    (tmp_path / "a-idx3-ubyte").write_bytes(_idx(images))
    (tmp_path / "a-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(images)))
    assert np.array_equal(read_idx(tmp_path / "a-idx3-ubyte"), images)
    assert np.array_equal(read_idx(tmp_path / "a-idx3-ubyte.gz"), images)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        read_idx(tmp_path / "bad")


def test_fashion_mnist_missing_says_how_to_install(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        fashion_mnist_split("train", root=tmp_path)


def test_arrays_to_folder_takes_disjoint_first_images(tmp_path) -> None:
    images = np.stack([np.full((8, 8), i, dtype=np.uint8) for i in range(12)])
    labels = np.array([0, 1, 2] * 4)
    arrays_to_folder(images, labels, ("a", "b", "c"), tmp_path / "train", per_class=3)
    arrays_to_folder(images, labels, ("a", "b", "c"), tmp_path / "val", skip_per_class=3)
    train, val = scan_folder(tmp_path / "train"), scan_folder(tmp_path / "val")
    assert train.per_class() == {"a": 3, "b": 3, "c": 3} and val.per_class() == {"a": 1, "b": 1, "c": 1}
    assert not {p.name for p in train.paths} & {p.name for p in val.paths}


def test_cifar_tarball_subset(tmp_path) -> None:
    tar_path = tmp_path / "cifar.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for cls in ("cat", "dog"):
            for i in range(4):
                buf = io.BytesIO()
                Image.new("RGB", (32, 32), (i * 40, 0, 0)).save(buf, format="JPEG")
                info = tarfile.TarInfo(f"train/{cls}/{i:04d}.jpg")
                info.size = len(buf.getvalue())
                tar.addfile(info, io.BytesIO(buf.getvalue()))
    out = cifar_tar_to_folder(tar_path, tmp_path / "out", per_class=2)
    assert scan_folder(out).per_class() == {"cat": 2, "dog": 2}
    # A validation set cut after the training images shares no file with them.
    val = cifar_tar_to_folder(tar_path, tmp_path / "val", per_class=2, skip_per_class=2)
    train_names = {p.name for p in scan_folder(out).paths}
    val_names = {p.name for p in scan_folder(val).paths}
    assert val_names == {"0002.jpg", "0003.jpg"} and not train_names & val_names
