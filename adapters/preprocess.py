"""Image preprocessing: the base model's own (timm's data config), shared by training, eval and serving.

Serving and ``memvit eval`` must see exactly what the adapter saw at validation time during
training, so there is one function for each and everything calls these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image, ImageOps
from timm.data import create_transform
from timm.data.transforms_factory import transforms_imagenet_train
from torch import Tensor

from memory_core import MemoryViT

Transform = Callable[[Image.Image], Tensor]


def to_rgb(image: Image.Image) -> Image.Image:
    """Upright RGB: honour EXIF orientation, first frame only, flatten alpha on white, any mode to RGB."""
    image = ImageOps.exif_transpose(image) or image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB") if image.mode != "RGB" else image


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
