"""A batch of decoded JPEGs -> the model's input, in a fixed number of tensor operations per batch.

The base's eval transform (resize the shorter side, centre crop, to float, normalise) written per
image costs ~11 operations an image (resize, two crop slices, the cast, two divisions, a
subtraction, the views around them). Each operation is a call through the dispatcher that releases
and retakes the GIL, and in a process that also launches the passes, that is where the time went
(docs/design.md §5). Here, an image costs two: its resize (an image's size is its own, so the
resize is its own call) and the view that gives it a batch dimension; images all of one size (and
one resize) cost none: they are stacked and resized in one call. The rest is done once for the
batch:

- the resized images are concatenated, channel by channel, into one flat buffer
  (``torch._chunk_cat``: one call for any number of images of any sizes);
- the centre crop, and the EXIF orientation (flips, transposes), are one gather from that buffer:
  pixel (y, x) of image b's crop lies at ``row[b, y] + col[b, x]``, two small tables computed on the
  host for the batch (numpy) and added on the device; when the images are all of one size and
  upright (one camera, a client's thumbnails, a single image), the crop is a window of the resized
  batch instead (two slices, no copy): the same pixels, without the tables or the gather;
- the normalisation ``(x / 255 - mean) / std`` is one multiply-add, ``x * a + b``, whose output is
  float32 whatever the input's dtype.

Resizing the image before orienting it (and orienting by the gather) is the same arithmetic as
orienting first, since the antialiased filter treats each axis alone; only the order in which an
axis's sums round can differ, within the tolerance the device path already has against Pillow.
On CUDA the antialiased resize needs float input (one ``_foreach`` cast for the batch) and, as
torchvision does there, its result is clamped and rounded to whole levels (two calls); on a CPU it
runs on uint8 as Pillow does. A crop larger than its resized image (zero padding) is rare (a
``Resize`` smaller than its ``CenterCrop``) and goes torchvision's way, image by image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from torch import Tensor
from torchvision.transforms import CenterCrop, InterpolationMode, Normalize, Resize
from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

TRANSPOSED, H_FLIPPED, V_FLIPPED = (5, 6, 7, 8), (2, 3, 6, 7), (3, 4, 7, 8)  # EXIF orientations
_MODES = {InterpolationMode.BILINEAR: "bilinear", InterpolationMode.BICUBIC: "bicubic"}
# What F.interpolate(x, size, mode, align_corners=False, antialias=True) calls for a 4-D x: called
# directly, without its checks of every argument per batch (the same operator, the same pixels).
_RESIZE = {"bilinear": torch._C._nn._upsample_bilinear2d_aa, "bicubic": torch._C._nn._upsample_bicubic2d_aa}
_UNKNOWN = object()


def eval_steps(transform: Callable) -> tuple[Resize, CenterCrop, Normalize]:
    """The resize, crop and normalisation of the base's eval transform, in that order (nothing else
    but the conversion to a tensor), so that the device path cannot drift from the CPU path."""
    steps = list(getattr(transform, "transforms", []))
    kinds = [type(step).__name__ for step in steps]
    if kinds != ["Resize", "CenterCrop", "MaybeToTensor", "Normalize"]:
        raise ValueError(f"the device decoder follows Resize, CenterCrop, ToTensor, Normalize; got {kinds}")
    return steps[0], steps[1], steps[3]


@dataclass(frozen=True)
class _Placement:
    """Where one image's crop lies in the flat buffer: its resize, and its gather's row and column
    tables' affine coefficients (``row = r0 + ry * y``, ``col = c0 + cx * x``)."""

    size: tuple[int, int]  # the resize's output (height, width), before orienting
    r0: int
    ry: int
    c0: int
    cx: int


class BatchPreprocess:
    """The base's eval transform for a batch of decoded (3, h, w) uint8 images on ``device``."""

    def __init__(self, transform: Callable, device: torch.device) -> None:
        self.resize, self.crop, normalize = eval_steps(transform)
        self.device = device
        self.crop_size = (int(self.crop.size[0]), int(self.crop.size[1]))
        self.mode = _MODES.get(self.resize.interpolation)  # None: torchvision's way, image by image
        # x * a + b == (x / 255 - mean) / std, (3, 1, 1) each: one multiply-add for the batch.
        std = torch.as_tensor(normalize.std, dtype=torch.float64).view(3, 1, 1)
        mean = torch.as_tensor(normalize.mean, dtype=torch.float64).view(3, 1, 1)
        self.scale = (1 / (255 * std)).float().to(device)
        self.shift = (-mean / std).float().to(device)
        self.on_uint8 = device.type == "cpu" and _native_uint8(self.resize.interpolation)
        self._tables: Tensor | None = None  # on CUDA: the device copy of the row and column tables
        self._places: dict[tuple[int, int, int], _Placement | None] = {}  # (h, w, orientation) -> _place

    def __call__(self, pictures: Sequence[Tensor], orientations: Sequence[int]) -> Tensor:
        """``pictures`` (3, h, w) uint8, each with its EXIF orientation -> (n, 3, H, W) float32."""
        if not pictures:
            return torch.empty(0, 3, *self.crop_size, device=self.device)
        known = self._places
        if len(known) > 4096:  # sizes seen: a camera's few, or anything a client sends (bounded)
            known.clear()
        places = []
        for p, o in zip(pictures, orientations, strict=True):
            key = (p.shape[-2], p.shape[-1], o)
            place = known.get(key, _UNKNOWN)
            if place is _UNKNOWN:
                place = known[key] = self._place(*key)
            places.append(place)
        if self.mode is None or any(place is None for place in places):
            return torch.stack([self._one(p, o) for p, o in zip(pictures, orientations, strict=True)])
        if _same_size(pictures, places):  # one resize for the batch (each image's alone, as one)
            batch = self._resized_together(pictures, places[0].size)  # (n, 3, h, w)
            if all(o == 1 for o in orientations):  # upright, one placement: the crop is a window
                x = _cropped(batch, places[0], self.crop_size)
            else:
                flat = batch.transpose(0, 1).reshape(1, 3, -1)  # channel by channel, as _chunk_cat's
                rows, cols = self._tables_for(places, [batch.shape[-2] * batch.shape[-1]] * len(places))
                x = flat.take(rows + cols)  # (n, 3, H, W), cropped and oriented: one gather
        else:
            if not self.on_uint8:
                pictures = torch._foreach_add(list(pictures), 0.0)  # one cast for the batch
            resized = [self._resized(p, place.size) for p, place in zip(pictures, places, strict=True)]
            flat = torch._chunk_cat(resized, dim=1, num_chunks=3)  # (1, 3, P): every image, per channel
            sizes = [r.shape[-2] * r.shape[-1] for r in resized]
            rows, cols = self._tables_for(places, sizes)
            x = flat.take(rows + cols)  # (n, 3, H, W), cropped and oriented: one gather (flat as 1-D)
        if not self.on_uint8:  # as torchvision does after a float resize of uint8 pixels
            x = x.clamp_(0, 255).round_()
        return torch.addcmul(self.shift, x, self.scale)  # float32 whatever x's dtype

    def _place(self, height: int, width: int, orientation: int) -> _Placement | None:
        """Image geometry on the host; None when the crop needs padding (torchvision's way)."""
        transposed = orientation in TRANSPOSED
        upright = (width, height) if transposed else (height, width)
        rh, rw = _compute_resized_output_size(upright, size=_size(self.resize), max_size=self.resize.max_size)
        ch, cw = self.crop_size
        if ch > rh or cw > rw:
            return None
        top, left = round((rh - ch) / 2.0), round((rw - cw) / 2.0)  # torchvision's anchor
        # Output (y, x) of the crop is the oriented image's (top + y, left + x); its (i, j) before the
        # flips, and (i, j) is the resized image's (row, col), or (col, row) when transposed.
        i0, si = (rh - 1 - top, -1) if orientation in V_FLIPPED else (top, 1)
        j0, sj = (rw - 1 - left, -1) if orientation in H_FLIPPED else (left, 1)
        size = (rw, rh) if transposed else (rh, rw)
        stride = size[1]  # the resized image's row length
        if transposed:  # resized[j, i]: the crop's rows walk its columns
            return _Placement(size, i0, si, j0 * stride, sj * stride)
        return _Placement(size, i0 * stride, si * stride, j0, sj)

    def _resized(self, picture: Tensor, size: tuple[int, int]) -> Tensor:
        batch = picture.unsqueeze(0)  # (1, 3, h, w): the resize's own shape
        if tuple(batch.shape[-2:]) == size:
            return batch
        return _RESIZE[self.mode](batch, list(size), False, None)

    def _resized_together(self, pictures: Sequence[Tensor], size: tuple[int, int]) -> Tensor:
        """Pictures of one size (3, h, w) resized to ``size`` in one call -> (n, 3, *size). The filter
        reads each image's own pixels only, so the batch's resize is each image's, bit for bit. Its
        flat buffer (``batch.transpose(0, 1)``, channel by channel) is the one ``_chunk_cat`` makes of
        the images one by one."""
        batch = torch.stack(list(pictures))  # (n, 3, h, w)
        if not self.on_uint8:
            batch = batch.float()
        if tuple(batch.shape[-2:]) != size:
            batch = _RESIZE[self.mode](batch, list(size), False, None)
        return batch

    def _tables_for(self, places: list[_Placement], sizes: list[int]) -> tuple[Tensor, Tensor]:
        """(n, 3, H, 1) rows and (n, 1, 1, W) columns whose sums index the flat buffer as one
        vector (each channel's rows offset by its place in it: ``take``, a plain gather, instead of
        indexing with broadcast index tensors, three times slower on a CPU)."""
        h, w = self.crop_size
        n = len(places)
        offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        coeff = np.array([(p.r0, p.ry, p.c0, p.cx) for p in places], dtype=np.int64).reshape(n, 4)
        host = np.empty(n * (3 * h + w), dtype=np.int64)
        rows = (offsets + coeff[:, 0])[:, None] + coeff[:, 1:2] * np.arange(h)  # (n, h)
        channels = np.arange(3, dtype=np.int64)[:, None] * sum(sizes)  # (3, 1): each channel's start
        host[: 3 * n * h].reshape(n, 3, h)[:] = rows[:, None, :] + channels
        host[3 * n * h :].reshape(n, w)[:] = coeff[:, 2:3] + coeff[:, 3:4] * np.arange(w)
        tables = self._on_device(host) if self.device.type == "cuda" else torch.from_numpy(host)
        rows = tables.as_strided((n, 3, h, 1), (3 * h, h, 1, 1))
        cols = tables.as_strided((n, 1, 1, w), (w, w, w, 1), 3 * n * h)
        return rows, cols

    def _on_device(self, host: np.ndarray) -> Tensor:
        """The tables on the device through pinned memory, without the host waiting. One buffer each
        way is enough: the decoder synchronises its stream before each batch (device_decode.py), so
        the previous batch's copy has run before this one's tables are written."""
        n = host.size
        if self._tables is None or self._tables.numel() < n:
            self._pinned = torch.empty(2 * n, dtype=torch.long, pin_memory=True)
            self._tables = torch.empty(2 * n, dtype=torch.long, device=self.device)
        self._pinned.numpy()[:n] = host
        return self._tables.copy_(self._pinned, non_blocking=True)

    def _one(self, picture: Tensor, orientation: int) -> Tensor:
        """torchvision's way, for a crop larger than its resized image or another interpolation."""
        resize = self.resize
        picture = TF.resize(
            orient(picture, orientation),
            resize.size,
            interpolation=resize.interpolation,
            max_size=resize.max_size,
            antialias=True,
        )
        picture = TF.center_crop(picture, list(self.crop_size))
        return torch.addcmul(self.shift, picture, self.scale)


def _same_size(pictures: Sequence[Tensor], places: list) -> bool:
    """Whether every picture has one shape and one resize (a batch of one camera's photos, or a
    client's thumbnails, or a single image): then they are resized together."""
    first, size = pictures[0].shape, places[0].size
    return all(p.shape == first for p in pictures) and all(q.size == size for q in places)


def _cropped(batch: Tensor, place: _Placement, crop: tuple[int, int]) -> Tensor:
    """The centre crop of an upright resized batch (n, 3, h, w): a window of it (two slices, no copy),
    the very pixels the gather's tables would pick, read by the normalisation's multiply-add."""
    top, left = divmod(place.r0 + place.c0, place.size[1])  # upright: r0 = top * w, c0 = left
    return batch[:, :, top : top + crop[0], left : left + crop[1]]


def orient(picture: Tensor, orientation: int) -> Tensor:
    """(C, H, W) -> upright, as ``PIL.ImageOps.exif_transpose`` turns the same EXIF orientation."""
    if orientation in TRANSPOSED:
        picture = picture.transpose(-1, -2)
    if orientation in H_FLIPPED:
        picture = picture.flip(-1)
    if orientation in V_FLIPPED:
        picture = picture.flip(-2)
    return picture


def _size(resize: Resize) -> list[int] | None:
    size = resize.size
    return [size] if isinstance(size, int) else list(size) if size is not None else None


def _native_uint8(interpolation: InterpolationMode) -> bool:
    """Whether torch resizes uint8 on this CPU itself (AVX2), as Pillow does; else through float."""
    try:
        from torchvision.transforms.v2.functional._geometry import _do_native_uint8_resize_on_cpu

        return bool(_do_native_uint8_resize_on_cpu(interpolation))
    except ImportError:
        return False
