"""The measurements benchmarks/serve.py makes, shared with the other serving benchmarks (front_end,
oip_load, ray_proxy): an adapter for a model, the model's raw and the decoders' rates, a photo at
the model's size, a process's CPU time, the server's batch sizes, and a result's row."""

from __future__ import annotations

import io
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from PIL import Image

from benchmarks.loadgen import LoadResult
from memvit.adapters.preprocess import to_rgb
from memvit.memory_core import AdapterSet, AdapterWeights, MemoryViT
from memvit.server.inference.images import ImageDecoder
from tests.factories import random_adapter

BATCHES = (1, 4, 8, 16, 32, 64)


def adapter(name: str, engine: MemoryViT) -> AdapterWeights:
    """A random adapter with one memory token and 100 classes."""
    return random_adapter(name, engine, m=1, classes=100, memory_std=0.02)


def raw_rate(
    engine: MemoryViT, adapter_set: AdapterSet, x: torch.Tensor, seconds: float
) -> tuple[float, float]:
    """(images/s, CPU seconds per image) of the fused pass on ``x``: at least ``seconds`` and 2 passes."""
    with torch.inference_mode():
        engine(x, adapter_set)  # warm
        done, cpu0, start = 0, time.process_time(), time.perf_counter()
        while done < 2 * len(x) or time.perf_counter() - start < seconds:
            engine(x, adapter_set)
            done += len(x)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return done / wall, cpu / done


def decode_rate(
    engine: MemoryViT, images: list[bytes], seconds: float, workers: int, mode: str = "exact"
) -> tuple[float, float]:
    """(images/s on ``workers`` threads, CPU seconds per image) of the server's own decoder."""
    decoder = ImageDecoder(engine, max_bytes=1 << 30, max_pixels=1 << 40, decode=mode)
    done, cpu0, start = 0, time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        while time.perf_counter() - start < seconds:
            list(pool.map(decoder, images))
            done += len(images)
    return done / (time.perf_counter() - start), (time.process_time() - cpu0) / done


def model_size_jpeg(engine: MemoryViT, data: bytes) -> bytes:
    """A photo as a client that resizes before uploading sends it: the eval transform's geometry
    (resize the short side, centre crop) at the model's input size, as a JPEG of quality 90."""
    config = engine.data_config()
    h, w = config["input_size"][-2:]
    image = to_rgb(Image.open(io.BytesIO(data)))
    scale = max(h / image.height, w / image.width)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    left, top = (image.width - w) // 2, (image.height - h) // 2
    out = io.BytesIO()
    image.crop((left, top, left + w, top + h)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its children alive now have used so far (a front
    end of several processes: the supervisor's children); None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(child[1]) == pid:
            total += process_cpu(int(stat.parent.name)) or 0.0
    return total


def batches(url: str) -> tuple[float, float]:
    """The server's images in fused passes so far, and its passes (its /metrics histogram)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = dict(re.findall(r"^memvit_batch_images_(sum|count) (\S+)$", text, re.M))
    return float(found["sum"]), float(found["count"])


def at_batch(sweep: dict[int, float], size: float) -> float:
    """The sweep's images/s at a batch size between its points (linear in log2 of the size)."""
    points = sorted(sweep)
    size = min(max(size, points[0]), points[-1])
    upper = next(b for b in points if b >= size)
    lower = max(b for b in points if b <= size)
    if upper == lower:
        return sweep[lower]
    t = (math.log2(size) - math.log2(lower)) / (math.log2(upper) - math.log2(lower))
    return sweep[lower] + t * (sweep[upper] - sweep[lower])


def row(label: str, r: LoadResult) -> str:
    return (
        f"| {label} | {r.requests} | {r.throughput:.1f} | {r.p50_ms:.0f} | {r.p99_ms:.0f} "
        f"| {', '.join(f'{k}: {v}' for k, v in sorted(r.statuses.items()))} |"
    )
