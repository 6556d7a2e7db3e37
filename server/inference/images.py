"""Uploaded bytes -> the base model's input tensor, with every way an upload can be wrong named.

Runs in a worker pool, never on the event loop. Only raster formats are opened (Pillow is told which
plugins it may use, so nothing hands a file to Ghostscript or the like); the pixel count is checked
from the header before anything is decoded (decompression bombs); the first frame of animations and
multi-picture files is used; EXIF orientation is applied; CMYK, grey, palette and alpha images become
RGB. Decoding (``load_rgb``, exact or fast) and preprocessing (``eval_transform``) are exactly what
``memvit eval`` uses.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError
from torch import Tensor

from memvit.adapters.preprocess import decode_target, eval_transform, load_rgb
from memvit.memory_core import MemoryViT

from ..errors import BrokenImageError, EmptyImageError, ImageTooLargeError, NotAnImageError

# Pillow plugin ids; multi-picture JPEGs (MPO) come in through the JPEG plugin.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


MAGIC = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)


def sniff(data: bytes) -> str | None:
    """The format an upload claims by its first bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((kind for magic, kind in MAGIC if data.startswith(magic)), None)


class ImageDecoder:
    def __init__(self, engine: MemoryViT, *, max_bytes: int, max_pixels: int, decode: str = "exact") -> None:
        self.transform = eval_transform(engine)
        self.shrink_to = decode_target(engine, decode)  # None: decode every pixel
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels

    def __call__(self, data: bytes, name: str = "image") -> Tensor:
        """Bytes of one upload -> (C, H, W) float tensor. Raises a ``ServiceError`` subclass."""
        return self.decode(self.open(data, name), name)

    def open(self, data: bytes, name: str = "image") -> Image.Image:
        """Every check that needs no pixels: the byte cap, a known raster format, a readable header,
        the pixel cap (decompression bombs). Returns the opened image, its pixels not yet decoded."""
        if not data:
            raise EmptyImageError(f"{name}: the file is empty", field=name)
        if len(data) > self.max_bytes:
            raise ImageTooLargeError(
                f"{name}: {len(data)} bytes is over the {self.max_bytes}-byte limit", field=name
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=FORMATS)
        except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
            raise ImageTooLargeError(f"{name}: {exc}", field=name) from None
        except UnidentifiedImageError:
            if kind := sniff(data):  # the right magic bytes, but Pillow cannot parse what follows
                raise BrokenImageError(
                    f"{name}: a damaged or truncated {kind} file (its header cannot be read)", field=name
                ) from None
            raise NotAnImageError(
                f"{name}: not an image in a supported format (JPEG, PNG, WebP, GIF, BMP, TIFF, MPO)",
                field=name,
            ) from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise BrokenImageError(f"{name}: cannot read the image header ({exc})", field=name) from None
        width, height = image.size
        if width * height > self.max_pixels:
            raise ImageTooLargeError(
                f"{name}: {width}x{height} = {width * height} pixels "
                f"is over the {self.max_pixels}-pixel limit",
                field=name,
            )
        return image

    def decode(self, image: Image.Image, name: str = "image") -> Tensor:
        """An image ``open`` passed -> (C, H, W) float tensor, decoded and preprocessed here."""
        try:
            rgb = load_rgb(image, shrink_to=self.shrink_to)
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            message = str(exc) or type(exc).__name__
            raise BrokenImageError(
                f"{name}: the image data is damaged or truncated ({message})", field=name
            ) from None
        return self.transform(rgb)
