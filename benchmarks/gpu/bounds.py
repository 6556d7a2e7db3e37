"""The server step's two bounds, per model: what the fused pass and the decoders do alone.

- model bound: the fused pass (8 adapters) at the server's batch size on preprocessed images, with
  the host-to-device copy as the server pays it (pageable), from pinned memory, and with copy and
  compute overlapped on two streams (what pinning could give);
- decode bound: the server's own decoders (``decode_bound``).

Also the photos, the model and the store every server row of the step uses.
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from benchmarks.common import DEIT_TINY, NATURAL_PHOTOS
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base

from .plan import ARCHS, DTYPES, Plan, adapters, engine, sync
from .server_variants import CALL_SIZES

SERVER_CALL_SIZES = tuple(int(size) for size in CALL_SIZES.split(","))

MAX_BATCH = {"cuda": 64, "cpu": 8}
DEVICE_BATCH = 64  # JPEGs per device decoder call, as the server's batches of 64 are
SMALLER_CALLS = (16, 1)  # and per call as a loaded server's batches were (mean 12-17) and alone
# Sizes in turn, 16 on average, as a server's batches come: torchvision initialises nvJPEG's batched
# decoder for each call's batch size, so whether a size unlike the last costs more shows against 16,
# and against the same calls padded by the server's decoder (MEMVIT_DEVICE_DECODE_CALL_SIZES).
MIXED_CALLS = (16, 9, 23, 4, 28, 11, 20, 17)


def bound(bounds: dict, key: str, measure, *args) -> dict:
    """``measure(*args)``, also kept in ``bounds[key]`` for the server rows that follow."""
    bounds[key] = measure(*args)
    return bounds[key]


def jpegs(plan: Plan) -> list[bytes]:
    """The shared data's natural photos as JPEGs (quality 90), or synthetic ones where it is absent."""
    sources = sorted(NATURAL_PHOTOS.iterdir()) if NATURAL_PHOTOS.is_dir() and not plan.smoke else []
    images = [Image.open(p).convert("RGB") for p in sources]
    if not images:
        size = (64, 48) if plan.smoke else (640, 480)
        images = [Image.radial_gradient("L").resize(size).convert("RGB").rotate(15 * i) for i in range(4)]
    out = []
    for image in images:
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def model(arch: str, plan: Plan, tmp: Path, dtype: str = "fp32") -> tuple[MemoryViT, Path]:
    """The engine the bounds time (on the device, in ``dtype``) and the weights file the server loads."""
    like = {"device": plan.device, "dtype": DTYPES[dtype]}
    if arch == "deit_tiny_patch16_224" and DEIT_TINY.is_file():
        return MemoryViT.from_timm(weights=str(DEIT_TINY), **like), DEIT_TINY
    e = engine(arch, replace(plan, device=torch.device("cpu")))  # saved from the host (safetensors)
    spec = dict(ARCHS[arch])
    name = spec.pop("arch", arch)
    path = save_base(e.base, tmp / "base.safetensors", arch=name, model_kwargs=spec or None)
    return MemoryViT.from_timm(weights=str(path), **like), path


def store(e: MemoryViT, path: Path) -> None:
    """8 adapters (m=1, 100 classes) in the server's store, as benchmarks/serve.py serves: bundle files,
    which the server registers (its store's one-time migration) when it starts."""
    from memvit.adapters import save_bundle

    path.mkdir(parents=True, exist_ok=True)
    for w in adapters(e, 8, 1, 100, prefix="task-"):
        save_bundle(bundle_for(w, e), path / f"{w.name}.safetensors")


def pixels(e: MemoryViT, photos: list[bytes], batch: int) -> torch.Tensor:
    from memvit.server.inference.images import ImageDecoder

    decoder = ImageDecoder(e, max_bytes=1 << 30, max_pixels=1 << 40)
    one = torch.stack([decoder(p) for p in photos])
    return one[torch.arange(batch) % len(one)]


def timed(fn, device: torch.device, seconds: float, images: int) -> float:
    fn()
    sync(device)
    done, start = 0, time.perf_counter()
    while done < 3 * images or time.perf_counter() - start < seconds:
        fn()
        done += images
    sync(device)
    return done / (time.perf_counter() - start)


def model_bound(e: MemoryViT, photos: list[bytes], plan: Plan) -> dict:
    batch, device = MAX_BATCH[plan.device.type], plan.device
    s = e.prepare_set(adapters(e, 8, 1, 100))
    host = pixels(e, photos, batch)
    seconds = plan.server_seconds / 6
    with torch.inference_mode():
        row = {"on device img/s": timed(lambda: e(host.to(device), s), device, seconds, batch)}
        if device.type == "cuda":
            on = host.to(device)
            row["resident img/s"] = timed(lambda: e(on, s), device, seconds, batch)
            pinned = host.pin_memory()
            row["pinned img/s"] = timed(
                lambda: e(pinned.to(device, non_blocking=True), s), device, seconds, batch
            )
            row["pinned, overlapped img/s"] = _overlapped(e, s, pinned, seconds)
    return row


def _overlapped(e: MemoryViT, s, pinned: torch.Tensor, seconds: float) -> float:
    """Copy batch i+1 on a side stream while batch i computes."""
    copy = torch.cuda.Stream()
    done, start = 0, time.perf_counter()
    with torch.cuda.stream(copy):
        nxt = pinned.to("cuda", non_blocking=True)
    while done < 3 * len(pinned) or time.perf_counter() - start < seconds:
        torch.cuda.current_stream().wait_stream(copy)
        current = nxt
        current.record_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy):
            nxt = pinned.to("cuda", non_blocking=True)
        e(current, s)
        done += len(pinned)
    torch.cuda.synchronize()
    return done / (time.perf_counter() - start)


def decode_bound(e: MemoryViT, photos: list[bytes], plan: Plan) -> dict:
    """The server's decoders alone: Pillow on every core (JPEGs decoded on the CPU), and the server's
    own device decoder (``DeviceDecoder.decode``, server/inference/device_decode.py) on batches of
    ``DEVICE_BATCH`` JPEGs, as the batcher calls it: whatever it does per batch and per image is in
    the figure. ``decode_jpeg img/s`` is torchvision's batched decode alone, for scale."""
    from memvit.server.inference.images import ImageDecoder

    decoder = ImageDecoder(e, max_bytes=1 << 30, max_pixels=1 << 40)
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    seconds = plan.server_seconds / 6
    with ThreadPoolExecutor(workers) as pool:
        row = {
            "cpu threads": workers,
            "cpu img/s": timed(
                lambda: list(pool.map(decoder, photos)), torch.device("cpu"), seconds, len(photos)
            ),
        }
    try:
        from torchvision.io import decode_jpeg

        from memvit.server.inference.device_decode import DeviceDecoder, Encoded
    except ImportError:
        return {**row, "gpu": "skipped: torchvision is not installed"}
    device = DeviceDecoder(decoder, plan.device)  # on CPU (the smoke) torchvision's CPU decoder
    items = [x for i, p in enumerate(photos) if isinstance(x := device.prepare(p, f"photo-{i}"), Encoded)]
    if not items:
        return {**row, "gpu": "skipped: no photo is a JPEG the device decoder takes"}
    batch = [items[i % len(items)] for i in range(DEVICE_BATCH)]
    key = "gpu img/s" if plan.device.type == "cuda" else "device decoder on cpu img/s"
    row[key] = timed(lambda: device.decode(batch), plan.device, seconds, len(batch))
    for size in SMALLER_CALLS:  # what a call costs at the batches a loaded server forms
        row[f"{key} at {size} per call"] = timed(
            lambda n=size: device.decode(batch[:n]), plan.device, seconds / 2, size
        )
    # each call the next photos on (a server's batches mix its photos in every order)
    starts = [sum(MIXED_CALLS[:j]) for j in range(len(MIXED_CALLS))]
    mixed = [
        [items[(a + i) % len(items)] for i in range(n)] for a, n in zip(starts, MIXED_CALLS, strict=True)
    ]
    row[f"{key} at mixed sizes per call (mean 16)"] = timed(
        lambda: [device.decode(call) for call in mixed], plan.device, seconds / 2, sum(MIXED_CALLS)
    )
    # the same calls padded by the server's own decoder (MEMVIT_DEVICE_DECODE_CALL_SIZES: 8x8 JPEGs,
    # their pictures dropped before the preprocessing) to one size, then to the server row's few
    for sizes in ((max(MIXED_CALLS),), SERVER_CALL_SIZES):
        padded = DeviceDecoder(decoder, plan.device, sizes)
        row[f"{key} at mixed sizes padded to {','.join(map(str, sizes))}"] = timed(
            lambda d=padded: [d.decode(call) for call in mixed], plan.device, seconds / 2, sum(MIXED_CALLS)
        )
    second = DeviceDecoder(decoder, plan.device)  # a stream of its own, as a second stage would have
    row[f"{key}, 2 threads"] = _two_threads((device, second), batch, plan.device, seconds / 2)
    raw = [torch.frombuffer(bytearray(item.data), dtype=torch.uint8) for item in batch]
    row["decode_jpeg img/s"] = timed(
        lambda: decode_jpeg(raw, device=plan.device), plan.device, seconds, len(batch)
    )
    return row


def _two_threads(decoders: tuple, batch: list, where: torch.device, seconds: float) -> float:
    """Two threads calling the decoder at once: whether a second decode stage would add throughput
    (torchvision's GPU decoder is one object behind a lock) or only contend."""
    with ThreadPoolExecutor(2) as pool:
        return timed(
            lambda: list(pool.map(lambda d: d.decode(batch), decoders)), where, seconds, 2 * len(batch)
        )
