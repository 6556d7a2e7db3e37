"""Step ``server``: the HTTP service on the device against its two bounds, per model.

- model bound: the fused pass (8 adapters) at the server's batch size on preprocessed images, with
  the host-to-device copy as the server pays it (pageable), from pinned memory, and with copy and
  compute overlapped on two streams (what pinning could give);
- decode bound: the server's own decoder (Pillow, on every core) on JPEG photos, and
  ``torchvision.io.decode_jpeg(device="cuda")`` plus resize and normalisation on the GPU;
- the server: ``memvit serve`` on the device (tests/server/launcher.py), closed-loop clients posting
  the photos, in variants (``VARIANTS``): JPEGs decoded on the GPU (the default there), the same at
  half the load it reached (paced clients: the goal p99 <= 2 x p50), and decoded on the CPU
  workers; goal >= 0.9 x min(its decode bound, the model bound), in the model's serving dtype
  (``SERVER_DTYPE``). Each row also gives the mean of every request stage (``memvit_stage_seconds``,
  scraped from /metrics after the load) and the mean batch, so a miss says where the time went.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from benchmarks.common import DEIT_TINY, NATURAL_PHOTOS
from benchmarks.loadgen import classify_requests, load
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base

from .plan import ARCHS, DTYPES, Plan, adapters, engine, sync
from .report import Budget, StepReport, goal
from .stage_metrics import stage_means, stage_sums

MAX_BATCH = {"cuda": 64, "cpu": 8}
# (label, the server's environment, its loads in turn): "full" is the plan's closed-loop clients,
# "half" the same clients paced at half what "full" reached. The first model gets the plan's
# ``server_variants`` first variants, the others the first alone.
# The last two are the two front ends of several processes (docs/design.md §5), to be measured
# on the GPU host and the faster kept: 8 API processes feeding one model process, or 8 replicas.
API_PROCESSES = "8"
VARIANTS: tuple[tuple[str, dict[str, str], tuple[str, ...]], ...] = (
    ("JPEG decode on the device", {"MEMVIT_DECODE_DEVICE": "auto"}, ("full", "half")),
    ("JPEG decode on the CPU", {"MEMVIT_DECODE_DEVICE": "cpu"}, ("full",)),
    (
        f"{API_PROCESSES} API processes, one model process",
        {"MEMVIT_API_PROCESSES": API_PROCESSES, "MEMVIT_FRONT_END": "model-process"},
        ("full",),
    ),
    (
        f"{API_PROCESSES} replicas",
        {"MEMVIT_API_PROCESSES": API_PROCESSES, "MEMVIT_FRONT_END": "replicas"},
        ("full",),
    ),
)
SERVER_DTYPE = {"vit_base_patch16_224": "bf16"}  # ViT-B/16 is served, and judged, in bfloat16
SERVER_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    try:  # the server's own dependencies (FastAPI, pydantic, ...): carried as wheels to a lent GPU
        import memvit.server.app  # noqa: F401
    except ImportError as exc:
        report.note(f"skipped: the server's dependencies are missing ({exc}); docs/gpu.md says what to carry")
        return "skipped"
    models = plan.server_models
    photos = _jpegs(plan)
    report.note(f"{len(photos)} JPEG photos, {sum(map(len, photos)) // len(photos) // 1024} KiB on average")
    for arch in models:
        if not budget.allows(3 * plan.server_seconds + 60):
            report.note(f"budget spent: stopped before {arch}")
            return "partial"
        dtype = SERVER_DTYPE.get(arch, "fp32")
        with tempfile.TemporaryDirectory(prefix="memvit-gpu-serve-") as tmp:
            e, weights = _model(arch, plan, Path(tmp), dtype)
            _store(e, Path(tmp) / "store")
            what = {"model": f"{arch} ({e.source})", "dtype": dtype, "batch": MAX_BATCH[plan.device.type]}
            bounds: dict = {}
            report.attempt("model bound", what, _bound, bounds, "model", _model_bound, e, photos, plan)
            report.attempt("decode bound", what, _bound, bounds, "decode", _decode_bound, e, photos, plan)
            chosen = VARIANTS[: plan.server_variants] if arch == models[0] else VARIANTS[:1]
            for label, env, loads in chosen:
                if not budget.allows(len(loads) * plan.server_seconds + 30):
                    report.note(f"budget spent: stopped before {arch}, {label}")
                    return "partial"
                env = {**env, "MEMVIT_DTYPE": SERVER_DTYPES[dtype]}
                for clients in plan.server_clients:
                    row = {**what, "variant": label, "clients": clients}
                    _serve(report, row, weights, Path(tmp), photos, clients, plan, bounds, env, loads)
    return "done"


def _bound(bounds: dict, key: str, measure, *args) -> dict:
    """``measure(*args)``, also kept in ``bounds[key]`` for the server rows that follow."""
    bounds[key] = measure(*args)
    return bounds[key]


def _jpegs(plan: Plan) -> list[bytes]:
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


def _model(arch: str, plan: Plan, tmp: Path, dtype: str = "fp32") -> tuple[MemoryViT, Path]:
    """The engine the bounds time (on the device, in ``dtype``) and the weights file the server loads."""
    like = {"device": plan.device, "dtype": DTYPES[dtype]}
    if arch == "deit_tiny_patch16_224" and DEIT_TINY.is_file():
        return MemoryViT.from_timm(weights=str(DEIT_TINY), **like), DEIT_TINY
    e = engine(arch, replace(plan, device=torch.device("cpu")))  # saved from the host (safetensors)
    spec = dict(ARCHS[arch])
    name = spec.pop("arch", arch)
    path = save_base(e.base, tmp / "base.safetensors", arch=name, model_kwargs=spec or None)
    return MemoryViT.from_timm(weights=str(path), **like), path


def _store(e: MemoryViT, path: Path) -> None:
    """8 adapters (m=1, 100 classes) in the server's store, as benchmarks/serve.py serves: bundle files,
    which the server registers (its store's one-time migration) when it starts."""
    from memvit.adapters import save_bundle

    path.mkdir(parents=True, exist_ok=True)
    for w in adapters(e, 8, 1, 100, prefix="task-"):
        save_bundle(bundle_for(w, e), path / f"{w.name}.safetensors")


def _pixels(e: MemoryViT, photos: list[bytes], batch: int) -> torch.Tensor:
    from memvit.server.images import ImageDecoder

    decoder = ImageDecoder(e, max_bytes=1 << 30, max_pixels=1 << 40)
    one = torch.stack([decoder(p) for p in photos])
    return one[torch.arange(batch) % len(one)]


def _timed(fn, device: torch.device, seconds: float, images: int) -> float:
    fn()
    sync(device)
    done, start = 0, time.perf_counter()
    while done < 3 * images or time.perf_counter() - start < seconds:
        fn()
        done += images
    sync(device)
    return done / (time.perf_counter() - start)


def _model_bound(e: MemoryViT, photos: list[bytes], plan: Plan) -> dict:
    batch, device = MAX_BATCH[plan.device.type], plan.device
    s = e.prepare_set(adapters(e, 8, 1, 100))
    host = _pixels(e, photos, batch)
    seconds = plan.server_seconds / 3
    with torch.inference_mode():
        row = {"on device img/s": _timed(lambda: e(host.to(device), s), device, seconds, batch)}
        if device.type == "cuda":
            on = host.to(device)
            row["resident img/s"] = _timed(lambda: e(on, s), device, seconds, batch)
            pinned = host.pin_memory()
            row["pinned img/s"] = _timed(
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


def _decode_bound(e: MemoryViT, photos: list[bytes], plan: Plan) -> dict:
    from memvit.server.images import ImageDecoder

    decoder = ImageDecoder(e, max_bytes=1 << 30, max_pixels=1 << 40)
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    seconds = plan.server_seconds / 3
    with ThreadPoolExecutor(workers) as pool:
        row = {
            "cpu threads": workers,
            "cpu img/s": _timed(
                lambda: list(pool.map(decoder, photos)), torch.device("cpu"), seconds, len(photos)
            ),
        }
    try:
        from torchvision.io import decode_jpeg
        from torchvision.transforms.v2 import functional as TF
    except ImportError:
        return {**row, "gpu": "skipped: torchvision is not installed"}
    if plan.device.type != "cuda":
        return {**row, "gpu": "skipped: no CUDA device"}
    config = e.data_config()
    size = config["input_size"][-2:]
    mean = torch.tensor(config["mean"], device="cuda")[:, None, None]
    std = torch.tensor(config["std"], device="cuda")[:, None, None]
    data = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in photos]

    def gpu_decode() -> None:
        for image in decode_jpeg(data, device="cuda"):
            image = TF.center_crop(
                TF.resize(image, int(size[0] / config.get("crop_pct", 0.875)), antialias=True), size
            )
            _ = (image.float() / 255 - mean) / std

    row["gpu img/s"] = _timed(gpu_decode, plan.device, seconds, len(photos))
    return row


def _serve(
    report: StepReport,
    row: dict,
    weights: Path,
    tmp: Path,
    photos: list[bytes],
    clients: int,
    plan: Plan,
    bounds: dict,
    env: dict[str, str],
    loads: tuple[str, ...],
) -> None:
    """One server with ``env``, then each of ``loads`` against it, a row each."""
    from tests.server.launcher import ServerProcess

    env = {
        "MEMVIT_DEVICE": plan.device.type,
        "MEMVIT_MAX_BATCH": str(MAX_BATCH[plan.device.type]),
        "MEMVIT_MAX_QUEUE": str(max(256, 4 * clients)),
        "MEMVIT_LOG_LEVEL": "warning",
        "MEMVIT_STORE_POLL_SECONDS": "60",
        **env,
    }
    try:
        server = ServerProcess(weights, tmp / "store", stderr=subprocess.DEVNULL, **env).start(timeout=300)
    except Exception as exc:  # recorded, and the step goes on
        report.add("server", {**row, "error": f"the server did not start: {exc}"[:500]})
        return
    model = bounds.get("model", {})
    model = model.get("resident img/s") or model.get("on device img/s")  # the pass on images on the device
    on_device = env.get("MEMVIT_DECODE_DEVICE", "auto") != "cpu" and plan.device.type == "cuda"
    decode = bounds.get("decode", {}).get("gpu img/s" if on_device else "cpu img/s")
    bound = min(b for b in (model, decode) if b) if (model or decode) else None
    try:
        requests = classify_requests("127.0.0.1", server.port, photos)
        reached = None
        for kind in loads:
            if kind == "half" and not reached:
                continue
            rate = None if kind == "full" else reached / 2
            what = {**row, "load": kind}
            if report.attempt("server", what, _load, server.url, requests, clients, plan, bound, rate):
                reached = reached or report.tables["server"][-1]["img/s"]
    finally:
        server.stop()


def _load(url: str, requests: list[bytes], clients: int, plan: Plan, bound: float | None, rate) -> dict:
    port = int(url.rsplit(":", 1)[1])
    before = stage_sums(url)
    result = asyncio.run(load("127.0.0.1", port, requests, clients, plan.server_seconds, rate=rate))
    stages = stage_means(before, stage_sums(url))
    share = result.throughput / bound if bound else None
    row = {
        "img/s": result.throughput,
        "p50 ms": result.p50_ms,
        "p99 ms": result.p99_ms,
        "p99 / p50": result.p99_ms / result.p50_ms,
        "statuses": result.statuses,
        "bound img/s": bound,
        "server / bound": share,
        **stages,
    }
    if rate is None:
        row["goal >= 0.9"] = goal(share, ">=", 0.9)
    else:
        row["offered img/s"] = rate
        row["goal p99 <= 2 x p50"] = goal(result.p99_ms / result.p50_ms, "<=", 2.0)
    return row
