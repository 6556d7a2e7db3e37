"""Batched preprocessing (server/inference/preprocess.py): the base's eval transform for a batch of decoded
JPEGs in two operations per image and a fixed number per batch, counted at the dispatcher, giving
what torchvision gives image by image."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from timm.data.transforms import MaybeToTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize

from memvit.memory_core import MemoryViT
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.images import ImageDecoder
from memvit.server.inference.preprocess import BatchPreprocess, orient
from tests.server.inference.test_device_decode import LEVELS, jpeg, photo

PER_IMAGE, PER_BATCH = 2, 10  # the goal (issue 41): aten operations on the device-decode path


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    @property
    def aten(self) -> int:
        return sum(n for op, n in self.ops.items() if op.startswith("aten."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def decoders(tiny_weights) -> tuple[ImageDecoder, DeviceDecoder]:
    engine = MemoryViT.from_timm(weights=tiny_weights)
    cpu = ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000)
    return cpu, DeviceDecoder(cpu, "cpu")


def uploads(n: int) -> list[bytes]:
    return [jpeg(photo(i, (180 + 29 * (i % 5), 140 + 17 * (i % 3)))) for i in range(n)]


@pytest.mark.parametrize("on_uint8", [True, False], ids=["uint8 (CPU)", "float (as on CUDA)"])
def test_a_batch_costs_two_operations_an_image_and_a_few_for_the_batch(decoders, on_uint8: bool) -> None:
    _, device = decoders
    device.preprocess.on_uint8 = on_uint8
    try:
        counts = {}
        for n in (1, 8, 24):
            items = [device.prepare(b, f"i{k}") for k, b in enumerate(uploads(n))]
            device.decode_batch(items)  # warm
            with Ops() as ops:
                x, failed = device.decode_batch(items)
            assert x.shape == (n, *device.shape) and not failed
            counts[n] = ops.aten
            assert ops.aten <= PER_IMAGE * n + PER_BATCH, ops.ops
        assert counts[24] - counts[8] <= PER_IMAGE * 16  # and no more per image as the batch grows
    finally:
        device.preprocess.on_uint8 = True


@pytest.mark.parametrize("on_uint8", [True, False], ids=["uint8 (CPU)", "float (as on CUDA)"])
def test_the_batch_matches_torchvision_image_by_image_and_pillow(decoders, on_uint8: bool) -> None:
    cpu, device = decoders
    prep = device.preprocess
    prep.on_uint8 = on_uint8
    try:
        blobs = uploads(7)
        items = [device.prepare(b, f"i{k}") for k, b in enumerate(blobs)]
        pictures = [TF.pil_to_tensor(cpu.open(b)) for b in blobs]  # uint8 (3, h, w)
        orientations = list(range(1, 8))  # every EXIF orientation but one, a different one each
        x = prep(pictures, orientations)
        for picture, o, out, blob in zip(pictures, orientations, x, blobs, strict=True):
            expected = prep._one(picture, o)  # torchvision's resize and crop of the oriented image
            assert (out - expected).abs().max() <= LEVELS
            if o == 1:
                assert (out - cpu(blob)).abs().max() <= LEVELS  # Pillow, the exact path
        x, _ = device.decode_batch(items)
        for out, blob in zip(x, blobs, strict=True):
            assert (out - cpu(blob)).abs().max() <= LEVELS
    finally:
        prep.on_uint8 = True


def test_upright_images_on_uint8_are_torchvisions_bit_for_bit(decoders) -> None:
    _, device = decoders
    pictures = [TF.pil_to_tensor(device.cpu.open(b)) for b in uploads(4)]
    x = device.preprocess(pictures, [1] * 4)
    for picture, out in zip(pictures, x, strict=True):
        assert torch.equal(out, device.preprocess._one(picture, 1))


def test_a_crop_larger_than_the_resized_image_is_padded_as_torchvision_pads_it() -> None:
    transform = Compose(
        [
            Resize(20, interpolation=InterpolationMode.BILINEAR),
            CenterCrop(32),
            MaybeToTensor(),
            Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        ]
    )
    prep = BatchPreprocess(transform, torch.device("cpu"))
    pictures = [TF.pil_to_tensor(photo(i, (60, 40))) for i in range(2)]
    x = prep(pictures, [1, 6])
    for picture, o, out in zip(pictures, [1, 6], x, strict=True):
        resized = TF.resize(orient(picture, o), [20], antialias=True)
        expected = (TF.center_crop(resized, [32, 32]).float() / 255 - 0.5) / 0.25
        assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("on_uint8", [True, False], ids=["uint8 (CPU)", "float (as on CUDA)"])
def test_pictures_of_one_size_are_resized_in_one_call_bit_for_bit(decoders, on_uint8: bool) -> None:
    """A batch of one size is stacked and resized once: each image exactly as alone, in a number of
    operations that does not grow with the batch."""
    _, device = decoders
    prep = device.preprocess
    prep.on_uint8 = on_uint8
    try:
        pictures = [TF.pil_to_tensor(photo(i, (180, 140))) for i in range(9)]
        orientations = [1 + i % 8 for i in range(9)]
        with Ops() as ops:
            together = prep(pictures, orientations)
        alone = torch.cat([prep([p], [o]) for p, o in zip(pictures, orientations, strict=True)])
        assert torch.equal(together, alone)
        with Ops() as more:
            prep(pictures * 3, orientations * 3)
        assert more.aten == ops.aten < PER_IMAGE * len(pictures), (ops.ops, more.ops)
    finally:
        prep.on_uint8 = True


@pytest.mark.parametrize("on_uint8", [True, False], ids=["uint8 (CPU)", "float (as on CUDA)"])
def test_upright_pictures_of_one_size_are_cropped_as_the_gather_crops_them(decoders, on_uint8: bool) -> None:
    """One size, upright: the crop is a window of the resized batch, no gather, the gather's result
    bit for bit (the same pictures beside one of another size take the gather)."""
    _, device = decoders
    prep = device.preprocess
    prep.on_uint8 = on_uint8
    try:
        pictures = [TF.pil_to_tensor(photo(i, (180, 140))) for i in range(5)]
        other = TF.pil_to_tensor(photo(9, (150, 200)))
        with Ops() as ops:
            window = prep(pictures, [1] * 5)
        gathered = prep([*pictures, other], [1] * 6)[:5]
        assert torch.equal(window, gathered) and window.is_contiguous()
        assert "aten.take" not in ops.ops and ops.aten <= 8, ops.ops
        assert torch.equal(prep(pictures[:1], [1]), gathered[:1])  # one image: a window too
    finally:
        prep.on_uint8 = True
