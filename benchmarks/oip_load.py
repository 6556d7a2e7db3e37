"""The Open Inference Protocol (binary tensor data) against multipart /classify, same images, same server.

    python -m benchmarks.oip_load                         # DeiT-Tiny, 8 adapters, the shared photos
    python -m benchmarks.oip_load --seconds 8 --rounds 2  # a quick look

One server (real DeiT-Tiny weights when present, 8 adapters of 100 classes), closed-loop clients
(benchmarks/loadgen.py: prepared requests on raw keep-alive sockets, so the generator costs the
shared cores little). Both protocols ask for the same work: every task for every image; /classify
answers top-1 per task in JSON, the protocol every task's logits as binary FP32. Rounds alternate
(multipart, protocol, multipart, ...) at each client count, and the ratio is the median of the
per-round ratios, so slow drifts of a shared machine cancel. The goal: the protocol costs at most 5%
of throughput.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import struct
import tempfile
from pathlib import Path

from benchmarks.common import (
    DEIT_TINY,
    argument_parser,
    deit_tiny_engine,
    environment,
    natural_photos,
    pin_malloc,
)
from benchmarks.loadgen import LoadResult, classify_requests, load
from benchmarks.serve_measures import adapter
from memvit.adapters import bundle_for, save_bundle
from memvit.memory_core import MemoryViT, save_base
from tests.server.launcher import ServerProcess


def oip_requests(host: str, port: int, images: list[bytes]) -> list[bytes]:
    """One ``POST /v2/models/base/infer`` per photo: a JSON header, then the image as BYTES binary data;
    every output asked for as binary data (tritonclient's default when no output is named)."""
    requests = []
    for data in images:
        blob = struct.pack("<I", len(data)) + data
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "IMAGE",
                        "datatype": "BYTES",
                        "shape": [1],
                        "parameters": {"binary_data_size": len(blob)},
                    }
                ],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
        body = header + blob
        head = (
            f"POST /v2/models/base/infer HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    return requests


def line(label: str, r: LoadResult) -> str:
    ok = r.statuses.get(200, 0)
    figures = f"{r.throughput:.1f} | {r.p50_ms:.0f} | {r.p99_ms:.0f}"
    return f"| {label} | {r.clients} | {figures} | {ok}/{r.completed} |"


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=12.0, help="per load phase")
    parser.add_argument("--rounds", type=int, default=3, help="alternating pairs per client count")
    parser.add_argument("--clients", default="1,32", help="comma-separated client counts")
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    images = [p.read_bytes() for p in natural_photos()]
    engine = deit_tiny_engine() if DEIT_TINY.is_file() else MemoryViT.from_timm("deit_tiny_patch16_224")
    adapters = [adapter(f"task-{i}", engine) for i in range(8)]
    print(environment(f"{engine.spec.arch} ({engine.source})", "8 adapters (m=1, 100 classes)",
                      f"{len(images)} photos", malloc) + "\n")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        for w in adapters:
            save_bundle(bundle_for(w, engine), store / f"{w.name}.safetensors")
        weights = DEIT_TINY
        if not DEIT_TINY.is_file():
            weights = Path(tmp) / "base.safetensors"
            save_base(engine.base, weights, arch=engine.spec.arch)
        server = ServerProcess(weights, store, stderr=None, MEMVIT_LOG_LEVEL="warning", MEMVIT_ADMIN_TOKEN="")
        server.start(timeout=120)
        port = server.port
        kinds = {"multipart /classify": classify_requests("127.0.0.1", port, images),
                 "protocol, binary": oip_requests("127.0.0.1", port, images)}  # fmt: skip
        try:
            for requests in kinds.values():  # warm-up, and both must answer 200
                warm = asyncio.run(load("127.0.0.1", port, requests, 4, 3.0))
                assert set(warm.statuses) == {200}, warm.statuses
            print("| protocol | clients | images/s | p50 ms | p99 ms | 200s |")
            print("|---|--:|--:|--:|--:|--:|")
            summary = []
            for clients in (int(c) for c in args.clients.split(",")):
                ratios, p99s = [], []
                for _ in range(args.rounds):
                    results = {}
                    for label, requests in kinds.items():
                        results[label] = asyncio.run(load("127.0.0.1", port, requests, clients, args.seconds))
                        print(line(label, results[label]), flush=True)
                    multipart, protocol = results.values()
                    ratios.append(protocol.throughput / multipart.throughput)
                    p99s.append(protocol.p99_ms / multipart.p99_ms)
                summary.append((clients, statistics.median(ratios), statistics.median(p99s)))
        finally:
            server.stop()
    print("\n| clients | protocol / multipart, images/s (median of rounds) | p99 ratio | goal >= 0.95 |")
    print("|--:|--:|--:|:-:|")
    for clients, ratio, p99 in summary:
        print(f"| {clients} | {ratio:.3f} | {p99:.3f} | {'met' if ratio >= 0.95 else 'MISSED'} |")


if __name__ == "__main__":
    main()
