"""The HTTP service under load, against the raw fused model, in one run.

    python benchmarks/serve.py                                   # DeiT-Tiny (real weights), ~2 minutes
    python benchmarks/serve.py --arch vit_base_patch16_224 --seconds 60   # the paper's ViT-B/16, ~6 min

1. Raw: the fused model in-process (8 adapters loaded) on preprocessed images at batch sizes
   1..32; its best images/s is the ceiling the server is measured against.
2. Server: ``memvit serve`` (a separate process, the same weights and 8 adapters in its store);
   1, 8 and 32 concurrent clients each post real photos (../shared/data/photos/natural/, one per
   request) for a fixed time; throughput, p50 and p99 latency.
3. Hot registration: 32 clients again, while another client registers and deletes a 9th adapter
   in a loop; p99 against step 2's 32-client p99.
The load generator (asyncio + httpx) runs on the same machine, so it takes CPU from the server:
the ratios are conservative. DeiT-Tiny real weights are used when ../shared/data has them.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters import bundle_for, save_bundle
from adapters.preprocess import eval_transform, to_rgb
from memory_core import AdapterWeights, MemoryViT, save_base
from memory_core.runtime import tune_malloc

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
DEIT = SHARED / "deit_tiny" / "deit_tiny_patch16_224.pipevit_mat_in1k.safetensors"


def adapters_for(engine: MemoryViT, k: int, m: int = 1) -> list[AdapterWeights]:
    spec, g = engine.spec, torch.Generator().manual_seed(0)
    cls_token = engine.base.cls_token.detach().reshape(-1)
    return [
        AdapterWeights(
            name=f"task-{i}",
            memory=0.02 * torch.randn(spec.depth, m, spec.width, generator=g),
            cls_token=cls_token.clone(),
            head_weight=0.02 * torch.randn(100, spec.width, generator=g),
            head_bias=torch.zeros(100),
        )
        for i in range(k)
    ]


def raw_throughput(engine: MemoryViT, images: list[bytes], seconds: float) -> dict[int, float]:
    transform = eval_transform(engine)
    x = torch.stack([transform(to_rgb(Image.open(io.BytesIO(d)))) for d in images])
    out = {}
    with torch.inference_mode():
        for batch in (1, 4, 8, 16, 32):
            xb = x[torch.arange(batch) % len(x)]
            engine(xb)
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                engine(xb)
                done += batch
            out[batch] = done / (time.perf_counter() - start)
    return out


def multipart_bodies(images: list[bytes]) -> tuple[str, list[bytes]]:
    """One pre-encoded ``image`` upload per photo, so the load generator spends little CPU per request."""
    boundary = "memvit-bench-boundary"
    bodies = [
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="p{i}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
        for i, data in enumerate(images)
    ]
    return f"multipart/form-data; boundary={boundary}", bodies


def decode_throughput(engine: MemoryViT, images: list[bytes], seconds: float, workers: int = 2) -> float:
    """Images/s of the server's own decoder (bytes -> preprocessed tensor) on ``workers`` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from server.images import ImageDecoder

    decoder = ImageDecoder(engine, max_bytes=1 << 30, max_pixels=1 << 40)
    done, start = 0, time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        while time.perf_counter() - start < seconds:
            list(pool.map(decoder, images))
            done += len(images)
    return done / (time.perf_counter() - start)


async def load(url: str, images: list[bytes], clients: int, seconds: float, stop_admin=None) -> dict:
    """``clients`` closed-loop clients for ``seconds``; figures from the steady-state window only.

    The first quarter of the run is ramp-up (the pipeline fills, batches form): requests that start
    in it are not counted. Throughput is the completions inside [start + ramp, deadline] over that
    window; latencies are those of the requests that started inside it.
    """
    done: list[tuple[float, float]] = []  # (start, end) per request
    statuses: dict[int, int] = {}
    content_type, bodies = multipart_bodies(images)
    start = time.perf_counter()
    deadline = start + seconds
    window_start = start + seconds / 4

    async def client(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            n = i
            while time.perf_counter() < deadline:
                body = bodies[n % len(bodies)]
                n += 1
                began = time.perf_counter()
                r = await http.post("/classify?top_k=1", content=body, headers={"content-type": content_type})
                done.append((began, time.perf_counter()))
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    if stop_admin is not None:
        stop_admin.set()
    completed = sum(window_start <= end <= deadline for _, end in done)
    latencies = [end - began for began, end in done if began >= window_start] or [0.0, 0.0]
    q = statistics.quantiles(latencies, n=100)
    return {
        "clients": clients,
        "requests": len(done),
        "throughput": completed / (deadline - window_start),
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * q[98],
        "statuses": statuses,
    }


async def admin_loop(url: str, bundle_bytes: bytes, stop: asyncio.Event, counts: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            r = await http.post("/adapters", files={"bundle": ("b", bundle_bytes)}, params={"replace": True})
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            await asyncio.sleep(0.25)
            r = await http.delete("/adapters/hot")
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            await asyncio.sleep(0.25)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per load phase")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument(
        "--arch",
        default="deit_tiny_patch16_224",
        help="timm architecture; DeiT-Tiny uses the real weights when present, others random init",
    )
    args = parser.parse_args(argv)
    tune_malloc()
    photos = sorted((SHARED / "photos" / "natural").iterdir())
    images = [p.read_bytes() for p in photos]
    real_weights = args.arch == "deit_tiny_patch16_224" and DEIT.is_file()
    engine = MemoryViT.from_timm(weights=str(DEIT)) if real_weights else MemoryViT.from_timm(args.arch)
    adapters = adapters_for(engine, 9)
    engine.set_adapters(adapters[:8])

    raw = raw_throughput(engine, images, seconds=4.0)
    best_batch = max(raw, key=raw.get)
    print(
        f"{engine.spec.arch} ({engine.source}), 8 adapters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {len(images)} photos"
    )
    print("| raw fused pass, batch | " + " | ".join(str(b) for b in raw) + " |")
    print("|---|" + "--:|" * len(raw))
    print("| images/s | " + " | ".join(f"{v:.1f}" for v in raw.values()) + " |\n")
    decode = decode_throughput(engine, images, seconds=4.0)
    ceiling = 1 / (1 / raw[best_batch] + 1 / decode)
    print(
        f"decoding + preprocessing these photos (the server's ImageDecoder, 2 threads): {decode:.1f} "
        f"images/s; with both on the same 2 cores, the server cannot exceed 1/(1/raw + 1/decode) = "
        f"{ceiling:.1f} images/s ({ceiling / raw[best_batch]:.0%} of raw) before any HTTP work\n"
    )

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        for w in adapters[:8]:
            save_bundle(bundle_for(w, engine), store / f"{w.name}.safetensors")
        hot = AdapterWeights(
            "hot", adapters[8].memory, adapters[8].cls_token, adapters[8].head_weight, adapters[8].head_bias
        )
        hot_bytes = bundle_for(hot, engine).to_bytes()
        port = 18000 + os.getpid() % 1000
        env = {
            **os.environ,
            "MEMVIT_ADAPTER_STORE": str(store),
            "MEMVIT_PORT": str(port),
            "MEMVIT_MAX_BATCH": str(args.max_batch),
            "MEMVIT_MAX_WAIT_MS": str(args.max_wait_ms),
            "MEMVIT_LOG_LEVEL": "warning",
        }
        if real_weights:
            env["MEMVIT_WEIGHTS"] = str(DEIT)
        else:  # random init: hand the server these very weights, so both measure the same model
            weights = Path(tmp) / "base.safetensors"
            save_base(engine.base, weights, arch=args.arch)
            env["MEMVIT_WEIGHTS"] = str(weights)
        server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve"], cwd=REPO, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            asyncio.run(load(url, images, 8, 3.0))  # warm-up
            rows = [asyncio.run(load(url, images, c, args.seconds)) for c in (1, 8, 32)]

            async def with_registrations() -> tuple[dict, dict]:
                stop, counts = asyncio.Event(), {}
                admin = asyncio.create_task(admin_loop(url, hot_bytes, stop, counts))
                row = await load(url, images, 32, args.seconds, stop_admin=stop)
                await admin
                return row, counts

            hot_row, admin_counts = asyncio.run(with_registrations())
        finally:
            server.terminate()
            server.wait(timeout=30)

    print("| clients | requests | images/s | p50 ms | p99 ms | statuses |\n|--:|--:|--:|--:|--:|---|")
    for r in [*rows, hot_row]:
        label = f"{r['clients']}" + (" + hot registration" if r is hot_row else "")
        print(
            f"| {label} | {r['requests']} | {r['throughput']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} "
            f"| {r['statuses']} |"
        )
    best = raw[best_batch]
    share = rows[2]["throughput"] / best
    p99_rise = hot_row["p99_ms"] / rows[2]["p99_ms"] - 1
    print(
        f"\nserver throughput at 32 clients / raw best (batch {best_batch}, {best:.1f} images/s): "
        f"{share:.1%} "
        f"({'ok' if share >= 0.85 else 'MISS'}, target >= 85%)"
    )
    print(
        f"p99 with registrations running ({admin_counts}): {p99_rise:+.1%} "
        f"({'ok' if p99_rise <= 0.20 else 'MISS'}, target <= +20%)"
    )


if __name__ == "__main__":
    main()
