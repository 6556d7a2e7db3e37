"""Step ``server``: the HTTP service on the device, right under load, against its two bounds.

Per model: the model bound and the decode bound (bounds.py), then ``memvit serve`` on the device
(tests/server/launcher.py) in variants (server_variants.py): the default front end on a GPU host (API
processes before one model process, JPEGs decoded on the GPU) at full load and paced at half of it
(the goal p99 <= 2 x p50); one process; replicas; JPEGs decoded on the CPU workers. The model is
served in its dtype (``SERVER_DTYPE``: ViT-B/16 in bfloat16). For each server:

- it is loaded only once the whole group is ready (its log says so), its log kept in the output
  folder (``server-<n>.log``, cut to its first and last lines when long);
- every photo is first sent alone (a batch of 1): its reference answer, logits included;
- the load: closed-loop clients from several processes (benchmarks/load_procs.py), every answer
  checked against its photo's reference (benchmarks/answers.py: logits within 1e-3 in float32,
  0.06 in bfloat16, the top-1 where the margin allows); a row gives img/s of right answers only,
  the answers by status and reason, p50/p99, the CPU milliseconds per image of every process
  (API processes, model process, the one process, the load generator), the mean of every request
  stage (``memvit_stage_seconds``) and the mean batch and pass, so a miss says where time went;
- on the default variant of the first model, two keys (``_two_keys``): one with 32 requests in
  flight, one light key with one; the light key's p50 beside the flood against its p50 alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
from pathlib import Path

from benchmarks.answers import TOLERANCE, classify_requests, references
from benchmarks.load_procs import Load, run_load
from benchmarks.processes import RoleClock

from .bounds import MAX_BATCH, bound, decode_bound, jpegs, model, model_bound, store
from .plan import Plan
from .report import Budget, StepReport, goal
from .server_variants import variants
from .stage_metrics import full_collections, graph_captures, stage_means, stage_p99_bounds, stage_sums

SERVER_DTYPE = {"vit_base_patch16_224": "bf16"}  # ViT-B/16 is served, and judged, in bfloat16
SERVER_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
HEAVY_IN_FLIGHT = 32
CROWD = 4  # "crowd": the default's full load with this many times the clients (is 64 in flight enough?)
LOG_HEAD, LOG_TAIL = 20_000, 60_000  # bytes of a server's log kept from its start and its end


def run(plan: Plan, report: StepReport, budget: Budget) -> str:
    try:  # the server's own dependencies (FastAPI, pydantic, ...): carried as wheels to a lent GPU
        import memvit.server.http.app  # noqa: F401
    except ImportError as exc:
        report.note(f"skipped: the server's dependencies are missing ({exc}); docs/gpu.md says what to carry")
        return "skipped"
    models = plan.server_models
    photos = jpegs(plan)
    report.note(f"{len(photos)} JPEG photos, {sum(map(len, photos)) // len(photos) // 1024} KiB on average")
    logs = iter(range(1, 100))
    for arch in models:
        if not budget.allows(3 * plan.server_seconds + 60):
            report.note(f"budget spent: stopped before {arch}")
            return "partial"
        dtype = SERVER_DTYPE.get(arch, "fp32")
        with tempfile.TemporaryDirectory(prefix="memvit-gpu-serve-") as tmp:
            e, weights = model(arch, plan, Path(tmp), dtype)
            store(e, Path(tmp) / "store")
            what = {"model": f"{arch} ({e.source})", "dtype": dtype, "batch": MAX_BATCH[plan.device.type]}
            bounds: dict = {}
            report.attempt("model bound", what, bound, bounds, "model", model_bound, e, photos, plan)
            report.attempt("decode bound", what, bound, bounds, "decode", decode_bound, e, photos, plan)
            del e
            ordered = variants(plan.device.type)
            chosen = ordered[: plan.server_variants] if arch == models[0] else ordered[:1]
            for index, (label, env, loads) in enumerate(chosen):
                if not budget.allows(len(loads) * plan.server_seconds + 30):
                    report.note(f"budget spent: stopped before {arch}, {label}")
                    return "partial"
                env = {**env, "MEMVIT_DTYPE": SERVER_DTYPES[dtype]}
                first = arch == models[0]
                loads = loads if first else loads[:1]  # the other models: full load only
                two_keys = first and index == 0
                for clients in plan.server_clients:
                    row = {**what, "variant": label, "clients": clients}
                    server = Served(report, row, weights, Path(tmp), env, next(logs), two_keys)
                    server.run(photos, clients, plan, bounds, loads, dtype, budget)
    return "done"


class Served:
    """One ``memvit serve`` of the step: started, loaded, its rows added, stopped, its log kept."""

    def __init__(
        self, report: StepReport, row: dict, weights: Path, tmp: Path, env: dict, n: int, keys: bool
    ) -> None:
        self.report, self.row, self.weights, self.tmp = report, row, weights, tmp
        self.log = report.out / f"server-{n}.log"
        self.tokens: dict[str, str] = {}
        self.env = {"MEMVIT_LOG_LEVEL": "warning", "MEMVIT_STORE_POLL_SECONDS": "60", **env}
        if keys:  # two keys: "heavy" (every load of this server) and "light"
            from memvit.server.tenancy.key_file import add_key

            path = tmp / f"keys-{n}.json"
            self.tokens = {k: add_key(path, k, ["*"], read=True, write=False) for k in ("heavy", "light")}
            self.env["MEMVIT_API_KEYS_FILE"] = str(path)

    def run(self, photos, clients: int, plan: Plan, bounds: dict, loads, dtype: str, budget: Budget) -> None:
        from tests.server.launcher import ServerProcess

        env = {
            "MEMVIT_DEVICE": plan.device.type,
            "MEMVIT_MAX_BATCH": str(MAX_BATCH[plan.device.type]),
            "MEMVIT_MAX_QUEUE": str(max(256, 4 * CROWD * clients)),
            **self.env,
        }
        group = env.get("MEMVIT_API_PROCESSES", "1") != "1"
        with self.log.open("wb") as log:
            try:
                server = ServerProcess(self.weights, self.tmp / "store", stderr=log, **env).start(timeout=300)
                if group:
                    _wait_for(self.log, "processes ready", 300)  # every process, not the first one
            except Exception as exc:  # recorded, and the step goes on
                self.report.add("server", {**self.row, "error": f"the server did not start: {exc}"[:500]})
                _cut(self.log)
                return
            try:
                self._loads(server, photos, clients, plan, bounds, loads, dtype, budget)
            finally:
                server.stop()
        _cut(self.log)

    def _loads(
        self, server, photos, clients: int, plan: Plan, bounds: dict, loads, dtype: str, budget: Budget
    ) -> None:
        heavy = self.tokens.get("heavy")
        requests, names = classify_requests("127.0.0.1", server.port, photos, token=heavy)
        refs = references("127.0.0.1", server.port, requests, names)
        model_bound = bounds.get("model", {})
        model_bound = model_bound.get("resident img/s") or model_bound.get("on device img/s")
        on_device = self.env.get("MEMVIT_DECODE_DEVICE", "auto") != "cpu" and plan.device.type == "cuda"
        decode = bounds.get("decode", {}).get("gpu img/s" if on_device else "cpu img/s")
        limit = min(b for b in (model_bound, decode) if b) if (model_bound or decode) else None
        common = {"server": server, "requests": requests, "names": names, "refs": refs}
        common["tolerance"] = TOLERANCE[dtype]
        reached = None
        for kind in loads:
            if kind == "half" and not reached:
                continue
            rate = reached / 2 if kind == "half" else None
            n = CROWD * clients if kind == "crowd" else clients
            what = {**self.row, "load": kind, "clients": n}
            if self.report.attempt("server", what, _load, common, n, plan, limit, rate):
                reached = reached or self.report.tables["server"][-1]["img/s"]
        if self.tokens and budget.allows(2 * plan.server_seconds + 10):
            light, _ = classify_requests("127.0.0.1", server.port, photos, token=self.tokens["light"])
            self.report.attempt("two keys", dict(self.row), _two_keys, common, light, plan)


def _load(common: dict, clients: int, plan: Plan, limit: float | None, rate: float | None) -> dict:
    server = common["server"]
    before, clock, began = stage_sums(server.url), RoleClock(server.pid), time.perf_counter()
    got = _run(common, common["requests"], clients, plan, rate=rate)
    cpu, threads, wall = clock.seconds(), clock.threads(), time.perf_counter() - began
    after = stage_sums(server.url)
    stages = stage_means(before, after)
    share = got.throughput / limit if limit else None
    images = max(got.ok, 1)
    row = {
        "img/s": got.throughput,
        "p50 ms": got.p50_ms,
        "p99 ms": got.p99_ms,
        "p99 / p50": got.p99_ms / got.p50_ms,
        "answers": got.statuses,
        "right": got.ok,
        "wrong or not 200": got.answered - got.ok,
        "bound img/s": limit,
        "server / bound": share,
        **{f"cpu ms/img {role}": 1e3 * seconds / images for role, seconds in cpu.items() if seconds > 0},
        "cpu ms/img load generator": 1e3 * got.client_cpu_s / images,
        # which of the engine's threads is busy: a decode thread near 1,000 ms a second is the limit
        "engine threads cpu ms/img": {name: 1e3 * s / images for name, s in threads.items()},
        "engine threads busy": {name: s / wall for name, s in threads.items()},  # of the wall clock
        **stages,
        # each stage's p99 (its histogram bucket's bound) and the whole request's as the server saw it:
        # a client p99 far above the request's is outside the server (the network, the load generator)
        "p99 bound ms by stage": stage_p99_bounds(before, after),
        **full_collections(before, after),  # each holds a process, its engine threads too
        **graph_captures(before, after),  # in a batch's way: a warm-up that missed a shape
    }
    if got.examples:
        row["examples"] = {reason: body[:300] for reason, body in list(got.examples.items())[:3]}
    row["goal all right"] = goal(got.answered - got.ok, "<=", 0)
    if rate is None:
        row["goal >= 0.9"] = goal(share, ">=", 0.9)
    else:
        row["offered img/s"] = rate
        row["goal p99 <= 2 x p50"] = goal(got.p99_ms / got.p50_ms, "<=", 2.0)
    return row


def _run(
    common: dict,
    requests: list[bytes],
    clients: int,
    plan: Plan,
    rate: float | None = None,
    seconds: float = 0.0,
) -> Load:
    """``run_load`` against the step's server, from several processes on a host with the cores."""
    server = common["server"]
    processes = max(1, min(8, clients, (os.cpu_count() or 1) // 4))
    return run_load(
        "127.0.0.1", server.port, requests, common["names"], clients, seconds or plan.server_seconds,
        references=common["refs"], tolerance=common["tolerance"], processes=processes, rate=rate,
    )  # fmt: skip


def _two_keys(common: dict, light: list[bytes], plan: Plan) -> dict:
    """The light key alone (one request in flight), then beside the heavy key's ``HEAVY_IN_FLIGHT``."""
    alone = _run(common, light, 1, plan, seconds=plan.server_seconds / 2)  # one client: steady soon
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        flood = pool.submit(_run, common, common["requests"], HEAVY_IN_FLIGHT, plan)
        beside = pool.submit(_run, common, light, 1, plan).result()
        heavy = flood.result()
    ratio = beside.p50_ms / alone.p50_ms
    wrong = sum(g.answered - g.ok for g in (alone, beside, heavy))
    return {
        "light p50 ms alone": alone.p50_ms,
        "light p50 ms beside": beside.p50_ms,
        "light p99 ms beside": beside.p99_ms,
        "heavy img/s": heavy.throughput,
        "light beside / alone": ratio,
        "wrong or not 200": wrong,
        "goal <= 1.5": goal(ratio, "<=", 1.5),
    }


def _wait_for(path: Path, text: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {text!r} in the server's log after {seconds:.0f} s")
        time.sleep(0.1)


def _cut(path: Path) -> None:
    """The log's first ``LOG_HEAD`` and last ``LOG_TAIL`` bytes (a lent machine returns little)."""
    data = path.read_bytes()
    if len(data) > LOG_HEAD + LOG_TAIL:
        cut = len(data) - LOG_HEAD - LOG_TAIL
        path.write_bytes(data[:LOG_HEAD] + b"\n[... %d bytes cut ...]\n" % cut + data[-LOG_TAIL:])
