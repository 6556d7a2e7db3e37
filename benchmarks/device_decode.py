"""The device decoder against the exact CPU decode: the model's input, its answers, and the speed.

    python -m benchmarks.device_decode                    # on CPU: the device path's code via libjpeg-turbo
    python -m benchmarks.device_decode --device cuda      # on a GPU host: nvJPEG, as `memvit serve` runs it

The shared real photos (photos/natural/) as JPEG uploads (the JPEGs as they are, the PNGs saved as
JPEG quality 90), plus the JPEG format cases (photos/formats/: EXIF orientation, grey, MPO, ICC...),
each turned into the model's input two ways: the exact CPU path (Pillow, ``ImageDecoder``, what
training saw) and the device decoder (server/inference/device_decode.py: torchvision's ``decode_jpeg`` on the
device, its antialiased resize, crop and normalisation). Printed: the largest difference of the
inputs (normalised units, and in levels of 255), the real DeiT-Tiny's largest logit drift and
top-1 agreement between the two, then images per second decoded and preprocessed in batches of 1
and 64 (median of ``--rounds``), each way.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable

import torch
from PIL import Image

from benchmarks.common import SHARED_DATA, argument_parser, deit_tiny_engine, environment, natural_photos
from memvit.server.inference.device_decode import DeviceDecoder, Encoded
from memvit.server.inference.images import ImageDecoder

LEVEL = 1 / 255 / 0.229  # one level of 255 in the normalised input (ImageNet's smallest std)


def uploads() -> list[tuple[str, bytes]]:
    """(name, JPEG bytes) of every shared photo and JPEG format case."""
    found = []
    for path in natural_photos():
        data = path.read_bytes()
        if path.suffix.lower() != ".jpg":
            out = io.BytesIO()
            Image.open(io.BytesIO(data)).convert("RGB").save(out, format="JPEG", quality=90)
            data = out.getvalue()
        found.append((path.name, data))
    formats = SHARED_DATA / "photos" / "formats"
    found += [(p.name, p.read_bytes()) for p in sorted(formats.glob("*.jpg")) + sorted(formats.glob("*.mpo"))]
    return found


def rate(fn: Callable[[], object], images: int, rounds: int, device: torch.device) -> float:
    """Images per second of ``fn`` (median of ``rounds`` calls after one warm-up)."""
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return images / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    engine = deit_tiny_engine()
    cpu = ImageDecoder(engine, max_bytes=1 << 28, max_pixels=1 << 28)
    gpu = DeviceDecoder(cpu, device)
    print(environment(f"device decoder on {device}"))
    items, exact, names = [], [], []
    for name, data in uploads():
        item = gpu.prepare(data, name)
        if not isinstance(item, Encoded):
            print(f"  {name}: not for the device decoder (decoded the CPU way)")
            continue
        items.append(item)
        exact.append(cpu(data, name))
        names.append(name)
    decoded = [t.cpu() for t in gpu.decode(items)]
    worst = [(t - e).abs().max().item() for t, e in zip(decoded, exact, strict=True)]
    with torch.inference_mode():
        a, b = engine(torch.stack(exact)).base, engine(torch.stack(decoded)).base
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    drift = (a - b).abs().max().item()
    print("| JPEGs | largest input difference | in levels of 255 | largest logit drift | top-1 agreement |")
    print("|--:|--:|--:|--:|--:|")
    print(f"| {len(items)} | {max(worst):.4f} | {max(worst) / LEVEL:.1f} | {drift:.4f} | {agree:.3f} |")
    print(f"worst image: {names[worst.index(max(worst))]}")
    blobs = [item.data for item in items]
    batch = [items[i % len(items)] for i in range(64)]
    print("| decode + resize + normalise | batch 1 img/s | batch 64 img/s |")
    print("|---|--:|--:|")
    one = rate(lambda: [cpu(b) for b in blobs[:1]], 1, args.rounds, device)
    many = rate(lambda: [cpu(blobs[i % len(blobs)]) for i in range(64)], 64, args.rounds, device)
    print(f"| CPU, Pillow, one thread | {one:.0f} | {many:.0f} |")
    one = rate(lambda: gpu.decode_batch(batch[:1]), 1, args.rounds, device)
    many = rate(lambda: gpu.decode_batch(batch), 64, args.rounds, device)
    print(f"| device decoder on {device} | {one:.0f} | {many:.0f} |")


if __name__ == "__main__":
    main()
