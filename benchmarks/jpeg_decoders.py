"""Which JPEG decoder for the fast decode: Pillow's draft mode against the libjpeg-turbo bindings.

    pip install simplejpeg "PyTurboJPEG<2"     # optional: a binding that is missing is skipped
    python -m benchmarks.jpeg_decoders         # ~1 minute on one CPU thread

The 15 shared photos as a phone uploads them (12 MP JPEG q90, ``benchmarks.decode.phone_jpeg``), each
decoded to an RGB PIL image by every decoder twice: at full size, and at the smallest libjpeg
DCT-domain scale (1/2, 1/4, 1/8) whose sides stay >= the side the eval transform resizes to (248
for DeiT-Tiny and ViT-B at 224), which is what ``MEMVIT_DECODE=fast`` asks of Pillow. Milliseconds
per image, median of interleaved rounds on one thread. PyTurboJPEG needs the system's libturbojpeg
(Debian: ``libturbojpeg0``, whose 2.x needs PyTurboJPEG 1.x).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

import torch
from PIL import Image, features

from benchmarks.common import argument_parser, environment, natural_photos
from benchmarks.decode import phone_jpeg

TARGET = 248  # decode_target(engine, "fast") for every 224-pixel model in this repository

Decoder = Callable[[bytes, int | None], Image.Image]


def pillow(data: bytes, shrink_to: int | None) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    if shrink_to:
        image.draft("RGB", (shrink_to, shrink_to))
    return image.convert("RGB")


def _simplejpeg() -> Decoder | None:
    try:
        import simplejpeg
    except ImportError:
        return None

    def decode(data: bytes, shrink_to: int | None) -> Image.Image:
        size = {"min_height": shrink_to, "min_width": shrink_to} if shrink_to else {}
        return Image.fromarray(simplejpeg.decode_jpeg(data, colorspace="RGB", **size))

    return decode


def _turbojpeg() -> Decoder | None:
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        jpeg = TurboJPEG()
    except (ImportError, OSError, RuntimeError):
        return None
    factors = sorted(jpeg.scaling_factors, key=lambda f: f[0] / f[1])

    def decode(data: bytes, shrink_to: int | None) -> Image.Image:
        scale = (1, 1)
        if shrink_to:
            width, height, _, _ = jpeg.decode_header(data)
            # The smallest scale that keeps both sides >= shrink_to (libjpeg rounds sizes up).
            scale = next(
                f for f in factors if min(-(-width * f[0] // f[1]), -(-height * f[0] // f[1])) >= shrink_to
            )
        return Image.fromarray(jpeg.decode(data, pixel_format=TJPF_RGB, scaling_factor=scale))

    return decode


def timed(decode: Decoder, images: list[bytes], shrink_to: int | None) -> float:
    started = time.perf_counter()
    for data in images:
        decode(data, shrink_to)
    return (time.perf_counter() - started) / len(images)


def main() -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = [phone_jpeg(p.read_bytes()) for p in natural_photos()]
    found = {"Pillow draft": pillow, "simplejpeg": _simplejpeg(), "PyTurboJPEG": _turbojpeg()}
    decoders = {name: d for name, d in found.items() if d is not None}
    sizes: dict[str, tuple[int, int]] = {}
    for name, decode in decoders.items():  # warm-up, and the sizes each one gives
        sizes[name] = decode(images[0], TARGET).size
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, decode in decoders.items():
            for mode, shrink in (("full", None), ("fast", TARGET)):
                times.setdefault((name, mode), []).append(timed(decode, images, shrink))
    print(
        environment(f"{len(images)} photos at 12 MP, JPEG q90", f"Pillow {Image.__version__}", "1 thread")
        + "\n"
    )
    print(f"libjpeg-turbo in Pillow: {features.version('libjpeg_turbo')}; missing: "
          f"{', '.join(n for n, d in found.items() if d is None) or 'none'}\n")  # fmt: skip
    print(
        "| decoder | full size ms/image | scaled to >= 248 ms/image | full / scaled | first photo scaled to |"
    )
    print("|---|--:|--:|--:|---|")
    for name in decoders:
        full = statistics.median(times[(name, "full")]) * 1e3
        fast = statistics.median(times[(name, "fast")]) * 1e3
        print(f"| {name} | {full:.2f} | {fast:.2f} | {full / fast:.2f} | {sizes[name][0]}x{sizes[name][1]} |")


if __name__ == "__main__":
    main()
