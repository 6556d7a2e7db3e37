"""Decoding uploads: every real format file in ../shared/data/photos/formats/, and every bad one."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from memvit.adapters.preprocess import decode_target, eval_transform, load_rgb, to_rgb
from memvit.adapters.training.data import ImageDataset, scan_folder
from memvit.memory_core import MemoryViT
from memvit.server.errors import BrokenImageError, EmptyImageError, ImageTooLargeError, NotAnImageError
from memvit.server.inference.images import ImageDecoder
from tests.server.conftest import photo

GOOD = [
    "exif-72dpi-int.jpg", "flower.jpg", "flower.webp", "flower2.jpg", "frozenpond.mpo", "hopper.bmp",
    "hopper.gif", "hopper.jpg", "hopper.png", "hopper.tif", "hopper.webp", "hopper_16bit_qtables.jpg",
    "hopper_gray.jpg", "hopper_orientation_6.jpg", "icc_profile_big.jpg", "iss634.webp",
    "pil_sample_cmyk.jpg", "sugarshack.mpo", "xmp_test.jpg",
]  # fmt: skip


@pytest.fixture(scope="module")
def decoder(tiny_weights) -> ImageDecoder:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    return ImageDecoder(engine, max_bytes=5_000_000, max_pixels=4_000_000)


@pytest.mark.parametrize("name", GOOD)
def test_every_supported_format_decodes(decoder, name) -> None:
    x = decoder(photo(name), name)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and torch.isfinite(x).all()


def test_exif_orientation_is_applied() -> None:
    upright = np.asarray(Image.open(io.BytesIO(photo("hopper.jpg"))).convert("RGB"), dtype=float)
    tagged = Image.open(io.BytesIO(photo("hopper_orientation_6.jpg")))
    assert np.abs(np.asarray(to_rgb(tagged), dtype=float) - upright).mean() < 10  # JPEG noise only
    assert np.abs(np.asarray(tagged.convert("RGB"), dtype=float) - upright).mean() > 50


def test_modes_become_rgb() -> None:
    for name in ("pil_sample_cmyk.jpg", "hopper_gray.jpg", "hopper.gif", "iss634.webp"):
        assert to_rgb(Image.open(io.BytesIO(photo(name)))).mode == "RGB", name
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red: flattened onto white
    assert to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)


def test_animation_uses_the_first_frame(decoder) -> None:
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    first = decoder(buf.getvalue())
    buf2 = io.BytesIO()
    frames[0].save(buf2, format="PNG")
    assert torch.allclose(first, decoder(buf2.getvalue()), atol=0.05)


def test_bad_uploads(decoder) -> None:
    with pytest.raises(EmptyImageError, match="the file is empty"):
        decoder(b"", "empty.jpg")
    with pytest.raises(NotAnImageError, match="not an image in a supported format"):
        decoder(b"%PDF-1.4 not an image", "doc.pdf")
    with pytest.raises(BrokenImageError, match="truncated"):
        decoder(photo("truncated_image.png"), "truncated_image.png")
    whole = photo("flower.jpg")
    with pytest.raises(BrokenImageError, match="damaged or truncated"):
        decoder(whole[: len(whole) // 2], "half.jpg")
    with pytest.raises(ImageTooLargeError, match="over the 5000000-byte limit"):
        decoder(b"\xff" * 5_000_001, "big.jpg")


def test_pixel_cap_stops_decompression_bombs(decoder) -> None:
    # 3000 x 3000 of one colour compresses to a few kB but would decode to 27 MB: refused from the header.
    buf = io.BytesIO()
    Image.new("L", (3000, 3000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(ImageTooLargeError, match="9000000 pixels is over the 4000000-pixel limit"):
        decoder(buf.getvalue(), "bomb.png")


def test_eps_is_never_handed_to_ghostscript(decoder) -> None:
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(NotAnImageError):
        decoder(eps, "x.eps")


# -- the fast decode (MEMVIT_DECODE=fast, memvit eval --decode fast) ------------------------------------
@pytest.fixture(scope="module")
def fast_decoder(tiny_weights) -> ImageDecoder:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    return ImageDecoder(engine, max_bytes=5_000_000, max_pixels=4_000_000, decode="fast")


def test_fast_decode_target_is_the_resize_side(decoder, fast_decoder, tiny_weights) -> None:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))  # 32x32 inputs, crop_pct 0.9: resized to 35
    assert decoder.shrink_to is None and fast_decoder.shrink_to == decode_target(engine, "fast") == 35
    with pytest.raises(ValueError, match="decode must be one of exact, fast"):
        decode_target(engine, "quick")


@pytest.mark.parametrize("name", GOOD)
def test_fast_decode_reads_every_format_close_to_exact(decoder, fast_decoder, name) -> None:
    exact, fast = decoder(photo(name), name), fast_decoder(photo(name), name)
    assert fast.shape == exact.shape and torch.isfinite(fast).all()
    # Same picture, same orientation (EXIF), same colours (CMYK, grey, palette): only resampling differs.
    # Normalised pixels span about 4 units; a wrong rotation or colour space is off by ~1 on average.
    assert (fast - exact).abs().mean() < 0.1, name
    assert torch.corrcoef(torch.stack([fast.flatten(), exact.flatten()]))[0, 1] > 0.97, name


@pytest.mark.parametrize(
    "name, shrunk",
    [
        ("hopper.jpg", (64, 64)),
        ("hopper_orientation_6.jpg", (64, 64)),
        ("flower.jpg", (60, 45)),
        ("frozenpond.mpo", (80, 60)),
    ],
)
def test_fast_decode_shrinks_jpegs_in_the_decoder(name, shrunk) -> None:
    # 128x128 -> 1/2 and 480x360 -> 1/8: the largest DCT scale leaving both sides >= 35.
    image = Image.open(io.BytesIO(photo(name)))
    full = image.size
    fast = load_rgb(image, shrink_to=35)
    assert fast.size == shrunk and min(fast.size) >= 35 and fast.size != full
    assert load_rgb(Image.open(io.BytesIO(photo(name)))).size in (full, full[::-1])  # exact: every pixel


def test_fast_decode_box_reduces_other_formats_to_two_to_four_times_the_target() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (1000, 700), (10, 200, 30)).save(buf, format="PNG")
    fast = load_rgb(Image.open(io.BytesIO(buf.getvalue())), shrink_to=35)
    assert 2 * 35 <= min(fast.size) < 4 * 35 and fast.size == (100, 70)  # reduced by 10
    assert fast.getpixel((50, 35)) == (10, 200, 30)
    small = load_rgb(Image.open(io.BytesIO(photo("hopper.png"))), shrink_to=35)
    assert small.size == (128, 128)  # under 4x the target: left as it is


def test_fast_decode_refuses_what_exact_refuses(fast_decoder) -> None:
    with pytest.raises(BrokenImageError, match="truncated"):
        fast_decoder(photo("truncated_image.png"), "truncated_image.png")
    whole = photo("flower.jpg")
    with pytest.raises(BrokenImageError, match="damaged or truncated"):
        fast_decoder(whole[: len(whole) // 2], "half.jpg")
    with pytest.raises(NotAnImageError):
        fast_decoder(b"%PDF-1.4 not an image", "doc.pdf")


@pytest.mark.parametrize("decode", ["exact", "fast"])
def test_serve_and_eval_decode_identically(tmp_path, tiny_weights, decode) -> None:
    # memvit eval (ImageDataset) and memvit serve (ImageDecoder) must hand the model the same tensor.
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    for folder, name in (("a", "flower.jpg"), ("a", "frozenpond.mpo"), ("b", "hopper_orientation_6.jpg")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name.replace(".mpo", ".jpg")).write_bytes(photo(name))
    samples = scan_folder(tmp_path)
    dataset = ImageDataset(samples, eval_transform(engine), shrink_to=decode_target(engine, decode))
    served = ImageDecoder(engine, max_bytes=5_000_000, max_pixels=4_000_000, decode=decode)
    for i, path in enumerate(samples.paths):
        assert torch.equal(dataset[i][0], served(path.read_bytes())), path.name
