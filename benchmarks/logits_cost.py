"""What asking for logits costs a request, in the GPU suite's answer shape, and the load generator's check.

    python -m benchmarks.logits_cost                          # 2 API processes, 3 rounds, ~1.5 min
    python -m benchmarks.logits_cost --against /tmp/then      # and another checkout's server, alternating
    python -m benchmarks.logits_cost --smoke                  # one short round (CI)

The GPU suite's server step asks every request for its logits (``top_k=1&logits=true``) to check
each answer under load against the image's answer alone (benchmarks/answers.py): a 1,000-class base
and 8 adapters of 100 classes, ~1,800 numbers in ~30 KB of JSON an answer. Here the same answer
shape on a base of one block of width 32 (32x32 inputs; the real pass, cheap), the 95 KiB JPEG of
benchmarks/front_end_cpu.py, 16 closed-loop clients of one load process, every answer checked
when logits are asked (as the suite does). Per request: the CPU of the API processes and of the
model process (/proc, benchmarks/processes.py), and of the load generator; with and without
logits, alternating. ``--check`` also times the check of one such answer: the prepared reference's
one-array check against the task-by-task one.
"""

from __future__ import annotations

import statistics
import tempfile
import timeit
from pathlib import Path

import numpy as np
from pydantic_core import from_json, to_json

from benchmarks.answers import check, classify_requests, logits_of, prepared, references
from benchmarks.common import argument_parser, environment
from benchmarks.front_end_cpu import against, padded_jpeg, start
from benchmarks.load_procs import run_load
from benchmarks.processes import RoleClock
from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT, save_base
from tests.factories import random_adapter

BASE = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=1000)
ADAPTER_CLASSES = 100
QUERIES = {"top 1": "top_k=1", "top 1 + logits": "top_k=1&logits=true"}


def measure(server, query: str, clients: int, seconds: float) -> dict[str, float]:
    """One phase: CPU ms per request by role (and the load generator's), requests/s."""
    requests, names = classify_requests("127.0.0.1", server.port, [padded_jpeg()], query=query)
    refs = references("127.0.0.1", server.port, requests, names) if "logits" in query else None
    clock = RoleClock(server.pid)
    got = run_load("127.0.0.1", server.port, requests, names, clients, seconds, references=refs)
    if got.ok != got.answered:
        raise RuntimeError(f"answers not all 200 and right: {got.statuses}")
    cpu = {role: 1e3 * s / got.answered for role, s in clock.seconds().items()}
    return {
        "api": cpu.get("api", cpu.get("server", 0.0)),
        "model": cpu.get("model", 0.0),
        "load": 1e3 * got.client_cpu_s / got.answered,
        "req/s": got.throughput,
    }


def check_cost(number: int = 5000) -> tuple[float, float, int]:
    """Microseconds to check one answer of this shape: prepared (one array), task by task; its bytes."""
    rng = np.random.default_rng(0)
    tasks = {"base": BASE["num_classes"], **{f"task-{i}": ADAPTER_CLASSES for i in range(8)}}
    answer = {t: rng.standard_normal(c).astype(np.float32).tolist() for t, c in tasks.items()}
    body = _answer_json(answer)
    got = logits_of(from_json(body))
    ready = prepared({"p": answer})["p"]
    if check(got, ready, 1e-3) is not None or check(got, ready.tasks, 1e-3) is not None:
        raise AssertionError("the timed answer must be a right one (both checks run to the end)")
    fast = timeit.timeit(lambda: check(got, ready, 1e-3), number=number) / number
    slow = timeit.timeit(lambda: check(got, ready.tasks, 1e-3), number=number) / number
    return 1e6 * fast, 1e6 * slow, len(body)


def _answer_json(logits: dict[str, list[float]]) -> bytes:
    results = [{"image": "p", "tasks": {t: {"predictions": [], "logits": v} for t, v in logits.items()}}]
    return to_json({"registry": {"version": 1, "adapters": 8}, "tasks": list(logits), "results": results})


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--config", default="2 device", help='front_end_cpu\'s "<processes> <decode>"')
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout: its server too, alternating")
    parser.add_argument("--smoke", action="store_true", help="one short round (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds = 2.0, 1
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **BASE)
    fast, slow, size = check_cost(200 if args.smoke else 5000)
    print(environment("one block of width 32, 1,000 classes", f"8 adapters of {ADAPTER_CLASSES} classes"))
    print(f"checking one answer ({size:,} bytes of JSON, parsed apart): {fast:.1f} us prepared, "
          f"{slow:.1f} us task by task\n", flush=True)  # fmt: skip
    bundles = {
        f"task-{i}": bundle_for(
            random_adapter(f"task-{i}", engine, m=1, classes=ADAPTER_CLASSES), engine
        ).to_bytes()
        for i in range(8)
    }
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "base.safetensors"
        save_base(engine.base, weights, arch="vit_tiny_patch16_224", model_kwargs=BASE)
        then = against(args.against, root) if args.against else None
        codes = {"now": args.config, **({"then": f"{args.config} then"} if then else {})}
        servers = {code: start(name, weights, root, bundles, then) for code, name in codes.items()}
        try:
            for r in range(args.rounds):
                for code in list(codes) if r % 2 == 0 else list(codes)[::-1]:
                    for label, query in QUERIES.items():
                        got = measure(servers[code], query, args.clients, args.seconds)
                        results.setdefault((code, label), []).append(got)
                        figures = ", ".join(f"{k} {v:.3f}" for k, v in got.items())
                        print(f"round {r + 1} {code} {label}: {figures}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print("\n| code | answer | API processes ms/req | model process ms/req | load generator ms/req | req/s |")
    print("|---|---|--:|--:|--:|--:|")
    for (code, label), runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        cells = [f"{med[k]:.3f}" for k in ("api", "model", "load")]
        print(f"| {code} | {label} | {' | '.join(cells)} | {med['req/s']:,.0f} |")


if __name__ == "__main__":
    main()
