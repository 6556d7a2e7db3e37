"""JPEG uploads decoded in batches on the model's device, resized and normalised there.

On a GPU host the CPU is what limits a vision service: one core decodes about 500 JPEGs a second
(torchvision on the H200's host), and the H200 decodes 11,000 a second in batches of 64 through
nvJPEG (``benchmarks/RESULTS.md``). So JPEGs skip the CPU decoder: every check that needs no pixels
runs first, on the CPU (``ImageDecoder.open``: the byte and pixel caps, decompression bombs, a
readable header), the EXIF orientation is read from the header there, and the bytes go to the
device, where ``decode`` turns a batch of them into the model's input with
``torchvision.io.decode_jpeg(list, device=...)`` (nvJPEG on CUDA; libjpeg-turbo, Pillow's own
library, on CPU, which is how CI runs this very code), the orientation, torchvision's antialiased
resize in the base's interpolation (which matches Pillow's to one level of 255), the centre crop and
the normalisation, all read off the base's own eval transform.

Whatever the device decoder does not take goes the exact CPU way (``ImageDecoder``): PNG, WebP,
GIF, BMP, TIFF, and JPEGs that are not RGB or grey (CMYK, YCCK); and a JPEG the device decoder
refuses in the batch is decoded by the CPU decoder alone, so a damaged file gets exactly the CPU
path's 4xx. torchvision is timm's dependency, so this adds nothing to install; torchvision 0.29
deprecates ``decode_jpeg`` in favour of TorchCodec, which decodes JPEG on the GPU through the same
nvJPEG: docs/design.md §5 says why this one for now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import CenterCrop, Normalize, Resize

from .errors import ServiceError
from .images import ImageDecoder

log = logging.getLogger(__name__)
ORIENTATION = 0x0112  # the EXIF tag
DEVICE_MODES = ("RGB", "L")  # JPEG colour models nvJPEG decodes to RGB as libjpeg does


@dataclass(frozen=True)
class Encoded:
    """An upload that passed every pixel-free check, to be decoded on the device."""

    data: bytes
    name: str
    orientation: int  # EXIF orientation, 1 (upright) to 8


class DeviceDecoder:
    """Decodes batches of JPEG uploads on ``device``; everything else through ``cpu``."""

    def __init__(self, cpu: ImageDecoder, device: torch.device | str) -> None:
        if cpu.shrink_to is not None:
            raise ValueError("the device decoder decodes every pixel: use it with decode='exact'")
        self.cpu = cpu
        self.device = torch.device(device)
        self.resize, self.crop, self.normalize = _steps(cpu.transform)
        self.mean = torch.as_tensor(self.normalize.mean, device=self.device).view(3, 1, 1)
        self.std = torch.as_tensor(self.normalize.std, device=self.device).view(3, 1, 1)

    def prepare(self, data: bytes, name: str = "image") -> Encoded | Tensor:
        """One upload, on a CPU worker: checked (raises the CPU path's 4xx), then either kept encoded
        for the device, or decoded here the exact CPU way when the device decoder does not take it."""
        image = self.cpu.open(data, name)
        if image.format in ("JPEG", "MPO") and image.mode in DEVICE_MODES and _complete(data):
            return Encoded(data, name, _orientation(image))
        return self.cpu.decode(image, name)

    def decode(self, items: list[Encoded]) -> list[Tensor | ServiceError]:
        """Encoded uploads -> each one's (C, H, W) float32 input on the device, or the error that
        answers its request. One decoder call for the batch; a file it refuses goes the CPU way."""
        if not items:
            return []
        raw = [torch.frombuffer(bytearray(item.data), dtype=torch.uint8) for item in items]
        try:
            pictures: list[Tensor | None] = list(decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError:  # one bad file fails the call: find it, decode the rest
            pictures = [self._one(r) for r in raw]
        out: list[Tensor | ServiceError] = []
        for item, picture in zip(items, pictures, strict=True):
            if picture is None:
                out.append(self._on_cpu(item))
            else:
                out.append(self._preprocess(_orient(picture, item.orientation)))
        return out

    def _one(self, raw: Tensor) -> Tensor | None:
        try:
            return decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return None

    def _on_cpu(self, item: Encoded) -> Tensor | ServiceError:
        """A JPEG the device decoder refused: the CPU decoder's answer, tensor or 4xx."""
        log.debug("%s: the device decoder refused it; decoding on the CPU", item.name)
        try:
            return self.cpu(item.data, item.name).to(self.device)
        except ServiceError as exc:
            return exc

    def _preprocess(self, picture: Tensor) -> Tensor:
        """(3, h, w) uint8 -> the base's input, as its eval transform makes it from a PIL image."""
        resize = self.resize
        picture = TF.resize(
            picture, resize.size, interpolation=resize.interpolation, max_size=resize.max_size, antialias=True
        )
        picture = TF.center_crop(picture, list(self.crop.size))
        return (picture.float() / 255 - self.mean) / self.std


def _steps(transform: Callable) -> tuple[Resize, CenterCrop, Normalize]:
    """The resize, crop and normalisation of the base's eval transform, in that order (nothing else
    but the conversion to a tensor), so that the device path cannot drift from the CPU path."""
    steps = list(getattr(transform, "transforms", []))
    kinds = [type(step).__name__ for step in steps]
    if kinds != ["Resize", "CenterCrop", "MaybeToTensor", "Normalize"]:
        raise ValueError(f"the device decoder follows Resize, CenterCrop, ToTensor, Normalize; got {kinds}")
    return steps[0], steps[1], steps[3]


def _complete(data: bytes) -> bool:
    """Whether a JPEG's last scan is followed by its end marker. A truncated file is not, and goes the
    CPU way, which names it (a decoder may fill in what is missing instead of failing). Entropy-coded
    data never holds the end marker's bytes (an 0xFF there is followed by 0x00 or a restart marker)."""
    return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda") >= 0


def _orientation(image: Image.Image) -> int:
    try:
        value = int(image.getexif().get(ORIENTATION, 1))
    except (ValueError, TypeError, OSError):  # an unreadable EXIF block: as the CPU path, upright
        return 1
    return value if 1 <= value <= 8 else 1


def _orient(picture: Tensor, orientation: int) -> Tensor:
    """(C, H, W) -> upright, as ``PIL.ImageOps.exif_transpose`` turns the same EXIF orientation."""
    if orientation in (5, 6, 7, 8):
        picture = picture.transpose(-1, -2)
    if orientation in (2, 3, 6, 7):
        picture = picture.flip(-1)
    if orientation in (3, 4, 7, 8):
        picture = picture.flip(-2)
    return picture
