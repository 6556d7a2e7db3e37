"""Image preprocessing: the base model's own (timm's data config), shared by training, eval and serving.

Serving and ``memvit eval`` must see exactly what the adapter saw at validation time during
training, so there is one function for each and everything calls these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from PIL import Image, ImageOps
from timm.data import create_transform
from timm.data.transforms_factory import transforms_imagenet_train
from torch import Tensor

from memvit.memory_core import MemoryViT

Transform = Callable[[Image.Image], Tensor]
# How uploads and evaluation images are decoded: "exact" decodes every pixel (what training saw);
# "fast" lets the decoder shrink large images first (benchmarks/RESULTS.md measures what it costs).
DECODE_MODES = ("exact", "fast")


def to_rgb(image: Image.Image) -> Image.Image:
    """Upright RGB: honour EXIF orientation, first frame only, flatten alpha on white, any mode to RGB."""
    image = ImageOps.exif_transpose(image) or image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB") if image.mode != "RGB" else image


def load_rgb(image: Image.Image, *, shrink_to: int | None = None) -> Image.Image:
    """An opened image -> its first frame, decoded, as upright RGB (``to_rgb``).

    ``shrink_to`` (the "fast" decode; see ``decode_target``) lets the decoder skip pixels the
    resize would average away anyway: a JPEG is decoded at 1/2, 1/4 or 1/8 scale in the DCT domain
    (libjpeg's scaled IDCT) to the smallest size whose sides are all >= ``shrink_to``; any image
    still over twice that on its short side is box-reduced by an integer factor to between two
    and four times it. The same resize, crop and normalisation follow, so only the pixels the
    resize starts from differ.
    """
    image.seek(0)  # the first frame of an animation or multi-picture file
    if shrink_to:
        image.draft(None, (shrink_to, shrink_to))  # JPEG only; a no-op for other formats
    image.load()
    rgb = to_rgb(image)
    if shrink_to and (factor := min(rgb.size) // (2 * shrink_to)) >= 2:
        rgb = rgb.reduce(factor)
    return rgb


def decode_target(engine: MemoryViT, decode: str) -> int | None:
    """``shrink_to`` for ``load_rgb``: None for "exact"; for "fast", the side the eval transform
    resizes to before its centre crop (so the image never drops below what the resize needs)."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if decode == "exact":
        return None
    config = engine.data_config()
    crop_pct = config.get("crop_pct") or 1.0
    return max(math.floor(side / crop_pct) for side in config["input_size"][-2:])


def eval_transform(engine: MemoryViT) -> Transform:
    """Resize, center crop and normalise as the base model was evaluated (timm's eval transform)."""
    config = engine.data_config()
    return create_transform(**_common(config), crop_pct=config.get("crop_pct"), is_training=False)


def train_transform(
    engine: MemoryViT, *, scale: tuple[float, float] = (0.35, 1.0), hflip: float = 0.5
) -> Transform:
    """Random-resized crop and horizontal flip at the base's input size, then the base's normalisation.

    No colour jitter or auto-augment: the paper's recipe for short fine-tunes.
    """
    config = engine.data_config()
    return transforms_imagenet_train(
        img_size=config["input_size"][-2:],
        scale=scale,
        hflip=hflip,
        color_jitter=None,
        interpolation=config.get("interpolation", "bicubic"),
        mean=config["mean"],
        std=config["std"],
    )


def _common(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_size": config["input_size"],
        "interpolation": config.get("interpolation", "bicubic"),
        "mean": config["mean"],
        "std": config["std"],
    }
