"""JPEG uploads decoded in batches on the model's device, resized and normalised there.

On a GPU host the CPU is what limits a vision service: one core decodes about 500 JPEGs a second
(torchvision on the H200's host), and the H200 decodes 11,000 a second in batches of 64 through
nvJPEG (``benchmarks/RESULTS.md``). So JPEGs skip the CPU decoder: every check that needs no pixels
runs first, on the CPU (``JpegCheck``: ``ImageDecoder.open``'s byte and pixel caps, decompression
bombs, a readable header; the EXIF orientation; a complete file), and the bytes go to the device,
where ``decode_batch`` turns a batch of them into the model's input with
``torchvision.io.decode_jpeg(list, device=...)`` (nvJPEG on CUDA; libjpeg-turbo, Pillow's own
library, on CPU, which is how CI runs this very code), then the base's eval transform for the whole
batch in a fixed number of operations (server/inference/preprocess.py: torchvision's antialiased resize in the
base's interpolation, which matches Pillow's to one level of 255, the orientation, the centre crop
and the normalisation, all read off the base's own eval transform).

Whatever the device decoder does not take goes the exact CPU way (``ImageDecoder``): PNG, WebP,
GIF, BMP, TIFF, and JPEGs that are not RGB or grey (CMYK, YCCK); and a JPEG the device decoder
refuses in the batch is decoded by the CPU decoder alone, so a damaged file gets exactly the CPU
path's 4xx. torchvision is timm's dependency, so this adds nothing to install; torchvision 0.29
deprecates ``decode_jpeg`` in favour of TorchCodec, which decodes JPEG on the GPU through the same
nvJPEG: docs/design.md §5 says why this one for now.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import warnings
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from ..errors import ServiceError
from .images import ImageDecoder
from .preprocess import BatchPreprocess

log = logging.getLogger(__name__)
ORIENTATION = 0x0112  # the EXIF tag
DEVICE_MODES = ("RGB", "L")  # JPEG colour models nvJPEG decodes to RGB as libjpeg does
READ_RGB = ImageReadMode.RGB


@dataclass(frozen=True)
class Encoded:
    """An upload that passed every pixel-free check, to be decoded on the device."""

    data: bytes | bytearray
    name: str
    orientation: int  # EXIF orientation, 1 (upright) to 8


class JpegCheck:
    """The CPU's part of the device path: every check that needs no pixels. It holds no device state:
    an API process runs it and never creates a CUDA context (docs/design.md §5)."""

    def __init__(self, cpu: ImageDecoder) -> None:
        if cpu.shrink_to is not None:
            raise ValueError("the device decoder decodes every pixel: use it with decode='exact'")
        self.cpu = cpu

    def __call__(self, data: bytes, name: str = "image") -> Encoded | Tensor:
        """One upload, on a CPU worker: checked (raises the CPU path's 4xx), then either kept encoded
        for the device, or decoded here the exact CPU way when the device decoder does not take it."""
        image = self.cpu.open(data, name)
        return self._encoded(image, data, name) or self.cpu.decode(image, name)

    def inline(self, data: bytes, name: str = "image") -> Encoded | None:
        """The check alone, where it is cheap enough for the event loop (tens of microseconds: the
        header and markers, no pixels; less than a hop to a worker thread and back): the upload kept
        encoded, its 4xx raised, or None when it must be decoded here (``__call__`` in a worker)."""
        return self._encoded(self.cpu.open(data, name), data, name)

    @staticmethod
    def _encoded(image: Image.Image, data: bytes, name: str) -> Encoded | None:
        if image.format in ("JPEG", "MPO") and image.mode in DEVICE_MODES and _complete(data):
            return Encoded(data, name, _orientation(image))
        return None


class DeviceDecoder:
    """Decodes batches of JPEG uploads on ``device``; everything else through ``cpu``.

    On CUDA it runs on a stream of its own and synchronises that stream before each decode. nvJPEG's
    hardware engine does not wait for the stream it is given (pytorch/vision#9606,
    meta-pytorch/torchcodec#1634), and the caching allocator hands the decoder blocks freed on this
    stream whose readers (the previous batch's resize and gather) may still be queued: with the
    stream drained, every block the decoder can be given is idle. The batch it returns is read on
    another stream (the pass's), so the caller records that stream on it (``Tensor.record_stream``)
    and the allocator keeps it until the pass has read it."""

    def __init__(
        self, cpu: ImageDecoder, device: torch.device | str, call_sizes: tuple[int, ...] = ()
    ) -> None:
        self.check = JpegCheck(cpu)
        self.cpu = cpu
        self.device = torch.device(device)
        self.preprocess = BatchPreprocess(cpu.transform, self.device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.barrier = True  # off only where a test shows what it prevents (tests/server/test_cuda_decode.py)
        # Each decoder call padded with a tiny JPEG up to the first of these sizes that holds it (none:
        # as it comes). torchvision initialises nvJPEG's batched decoder for every call's size; whether
        # a size unlike the last costs is the GPU suite's `at mixed sizes` question (docs/gpu.md).
        if list(call_sizes) != sorted(set(call_sizes)) or any(size < 1 for size in call_sizes):
            raise ValueError(f"decoder call sizes must be positive and ascending, not {call_sizes}")
        self.call_sizes = tuple(call_sizes)
        self._filler = _FROM_BUFFER(_FILLER, dtype=_UINT8)

    def twin(self) -> DeviceDecoder:
        """A decoder for another thread: the same checks and preprocessing, a stream of its own (its
        barrier then waits for its own batches only). torchvision's GPU decoder is one object behind
        a lock, so two threads overlap everything but the decoder's own call."""
        twin = DeviceDecoder(self.cpu, self.device, self.call_sizes)
        twin.barrier = self.barrier
        return twin

    @property
    def shape(self) -> tuple[int, int, int]:
        """One image's input (C, H, W)."""
        return (3, *self.preprocess.crop_size)

    def prepare(self, data: bytes, name: str = "image") -> Encoded | Tensor:
        return self.check(data, name)

    def decode(self, items: list[Encoded]) -> list[Tensor | ServiceError]:
        """Encoded uploads -> each one's (C, H, W) float32 input on the device, or the error that
        answers its request (``decode_batch``, cut per image)."""
        if not items:
            return []
        x, failed = self.decode_batch(items)
        return [failed.get(i, t) for i, t in enumerate(x.unbind(0))]

    def decode_batch(self, items: list[Encoded]) -> tuple[Tensor, dict[int, ServiceError]]:
        """Encoded uploads -> (n, C, H, W) float32 on the device (on CUDA, queued on ``stream``), and
        the error that answers each image that has no input (its row holds zeros). One decoder
        call for the batch; a file it refuses goes the CPU way."""
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda and self.barrier:
                self.stream.synchronize()  # nothing queued here still reads what the decoder is given
            raw = [_FROM_BUFFER(item.data, dtype=_UINT8) for item in items]  # the bytes, not copied
            try:
                pictures: list[Tensor | None] = self._decoded(raw)
            except RuntimeError:  # one bad file fails the call: find it, decode the rest
                pictures = [self._one(r) for r in raw]
            decoded = [i for i, p in enumerate(pictures) if p is not None]
            x = self.preprocess([pictures[i] for i in decoded], [items[i].orientation for i in decoded])
            if len(decoded) == len(items):
                return x, {}
            return self._with_refused(items, decoded, x)

    def _decoded(self, raw: list[Tensor]) -> list[Tensor | None]:
        """The batch's pictures (3, h, w) uint8: nvJPEG's one call for the batch on CUDA. On a CPU,
        torchvision's ``decode_jpeg`` of a list is this loop over its operator, after checks and a
        deprecation warning per call (a few microseconds a batch, and the mode's enum read per image).
        With ``call_sizes``, the call padded with fillers, whose pictures are dropped here."""
        n = len(raw)
        size = self.call_size(n)
        if size > n:
            raw = raw + [self._filler] * (size - n)
        if self.cuda:
            return list(decode_jpeg(raw, mode=READ_RGB, device=self.device))[:n]
        return [_DECODE_ON_CPU(r, _RGB, False) for r in raw][:n]  # (data, mode, apply_exif_orientation)

    def call_size(self, n: int) -> int:
        """How many images the decoder is given for ``n`` uploads: the first of ``call_sizes`` that
        holds them, or ``n`` itself (none set, or more than the largest)."""
        at = bisect.bisect_left(self.call_sizes, n)
        return self.call_sizes[at] if at < len(self.call_sizes) else n

    def _with_refused(
        self, items: list[Encoded], decoded: list[int], x: Tensor
    ) -> tuple[Tensor, dict[int, ServiceError]]:
        """The batch, with the JPEGs the device decoder refused decoded the CPU way (or their 4xx)."""
        failed: dict[int, ServiceError] = {}
        rows, parts = list(decoded), [x] if decoded else []
        done = set(decoded)
        for i, item in enumerate(items):
            if i in done:
                continue
            out = self._on_cpu(item)
            if isinstance(out, ServiceError):
                failed[i] = out
            else:
                rows.append(i)
                parts.append(out.unsqueeze(0))
        full = torch.zeros(len(items), *self.shape, device=self.device)
        if parts:
            full.index_copy_(0, torch.tensor(rows).to(self.device), torch.cat(parts))
        return full, failed

    def _one(self, raw: Tensor) -> Tensor | None:
        try:
            return decode_jpeg(raw, mode=READ_RGB, device=self.device)
        except RuntimeError:
            return None

    def _on_cpu(self, item: Encoded) -> Tensor | ServiceError:
        """A JPEG the device decoder refused: the CPU decoder's answer, tensor or 4xx."""
        log.debug("%s: the device decoder refused it; decoding on the CPU", item.name)
        try:
            return self.cpu(item.data, item.name).to(self.device)
        except ServiceError as exc:
            return exc


def _quiet_read_only_once() -> None:
    """``torch.frombuffer`` of ``bytes`` (an upload, read-only) warns, once per process, that the tensor
    could write to it. The decoder only reads it, so the bytes are not copied to make them writable
    (a photo's 100 KiB per image): that one warning is taken here, where the reason is known, not in
    a request's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


def _tiny_jpeg() -> bytes:
    """An 8x8 grey JPEG (~630 bytes): a filler that costs the decoder next to nothing but its slot."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


_quiet_read_only_once()
_FILLER = _tiny_jpeg()
_FROM_BUFFER, _UINT8, _RGB = torch.frombuffer, torch.uint8, READ_RGB.value
_DECODE_ON_CPU = torch.ops.image.decode_jpeg.default  # what torchvision's decode_jpeg calls per image


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
