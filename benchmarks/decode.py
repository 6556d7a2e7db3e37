"""What the fast decode saves and what it costs in accuracy, against the exact decode, in one run.

    python -m benchmarks.decode                       # real DeiT-Tiny, ~2 minutes on 2 CPU cores
    python -m benchmarks.decode --cifar 10000         # every CIFAR-10 test image

Both decodes run through the server's own ``ImageDecoder`` (``MEMVIT_DECODE=exact|fast``; ``memvit
eval --decode`` uses the same ``load_rgb``), on:
- the shared real photos (photos/natural/, as uploaded: PNG and JPEG of 0.2 to 2 megapixels);
- the same photos as a phone uploads them: resized to 4032x3024 (or 3024x4032) and saved as JPEG q90;
- the shared format edge cases (photos/formats/: EXIF, CMYK, grey, MPO, palette, WebP, ...);
- the CIFAR-10 test JPEGs (32x32: nothing to shrink, so the two decodes must agree exactly).
Per set: decode milliseconds per image on one thread (median of ``--rounds`` interleaved rounds),
then the real DeiT-Tiny's ImageNet logits from both inputs: the largest and the mean absolute logit
drift, top-1 agreement between the decodes, and for CIFAR-10 nothing more (ImageNet labels do not
apply to it).
"""

from __future__ import annotations

import io
import statistics
import tarfile
import time
from collections.abc import Sequence

import torch
from PIL import Image

from benchmarks.common import (
    CIFAR10,
    SHARED_DATA,
    argument_parser,
    deit_tiny_engine,
    environment,
    natural_photos,
    pin_malloc,
)
from memvit.memory_core import MemoryViT
from memvit.server.inference.images import ImageDecoder

PHONE = (4032, 3024)  # a 12-megapixel phone photo


def phone_jpeg(data: bytes) -> bytes:
    """A photo as a phone would upload it: 12 megapixels in its own orientation, JPEG quality 90."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    size = PHONE if image.width >= image.height else PHONE[::-1]
    out = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(out, format="JPEG", quality=90)
    return out.getvalue()


def cifar_jpegs(limit: int) -> list[bytes]:
    """The first ``limit`` CIFAR-10 test JPEGs of the shared tarball, as uploaded bytes."""
    found = []
    with tarfile.open(CIFAR10 / "cifar10_jpg_test_10k.tar.gz") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".jpg"):
                found.append(tar.extractfile(member).read())
                if len(found) == limit:
                    break
    return found


def decode_ms(decoders: dict[str, ImageDecoder], images: Sequence[bytes], rounds: int) -> dict[str, float]:
    """Milliseconds per image of each decoder on one thread: median over interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(rounds):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            for data in images:
                decoder(data)
            times[name].append((time.perf_counter() - start) * 1000 / len(images))
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def drift(engine: MemoryViT, exact: torch.Tensor, fast: torch.Tensor) -> tuple[float, float, float]:
    """(max |logit drift|, mean |logit drift|, top-1 agreement) of the base's logits, fast vs exact."""
    a = torch.cat([engine(x).base for x in exact.split(32)])
    b = torch.cat([engine(x).base for x in fast.split(32)])
    diff = (a - b).abs()
    return diff.max().item(), diff.mean().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--cifar", type=int, default=2000, help="CIFAR-10 test images to use")
    args = parser.parse_args(argv)
    pin_malloc()
    engine = deit_tiny_engine(labels=True)
    decoders = {
        mode: ImageDecoder(engine, max_bytes=1 << 30, max_pixels=1 << 40, decode=mode)
        for mode in ("exact", "fast")
    }
    photos = [p.read_bytes() for p in natural_photos()]
    formats_dir = SHARED_DATA / "photos" / "formats"
    formats = [p.read_bytes() for p in sorted(formats_dir.iterdir()) if p.name != "truncated_image.png"]
    sets = {
        "real photos (as uploaded)": photos,
        "real photos at 12 MP, JPEG q90": [phone_jpeg(p) for p in photos],
        "format edge cases": formats,
        f"CIFAR-10 test JPEGs ({args.cifar})": cifar_jpegs(args.cifar),
    }
    print(environment(f"decode on 1 thread, {args.rounds} rounds; model: real DeiT-Tiny"))
    print(f"shrink target of the fast decode: {decoders['fast'].shrink_to} px (the eval resize side)\n")
    print(
        "| images | n | exact ms/image | fast ms/image | exact / fast | max logit drift "
        "| mean drift | top-1 agreement |\n|---|--:|--:|--:|--:|--:|--:|--:|"
    )
    for label, images in sets.items():
        rounds = args.rounds if len(images) < 100 else 1  # CIFAR: thousands of tiny images, one round
        ms = decode_ms(decoders, images, rounds)
        exact = torch.stack([decoders["exact"](d) for d in images])
        fast = torch.stack([decoders["fast"](d) for d in images])
        worst, mean, agree = drift(engine, exact, fast)
        print(
            f"| {label} | {len(images)} | {ms['exact']:.2f} | {ms['fast']:.2f} "
            f"| {ms['exact'] / ms['fast']:.2f} | {worst:.3f} | {mean:.4f} | {agree:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
