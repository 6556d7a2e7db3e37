"""The GPU suite's CPU form: every step runs and writes its report, so the suite cannot rot between
the rare hours a GPU is lent (docs/gpu.md); what ``--all`` plans for the GPU; the profile's trace
arithmetic; the import check every device command starts with."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu import imports, wheels
from benchmarks.gpu.__main__ import STEPS, main
from benchmarks.gpu.plan import Plan
from benchmarks.gpu.schedule import ALL, BUDGET_S
from benchmarks.gpu.trace import summarize

TABLES = {
    "exactness": {"synthetic bases"},
    "engine": {
        "base only vs timm",
        "fused vs R(K)",
        "dense reference",
        "try: SDPA backend, base path",
        "try: CUDA graphs on vs off",
        "try: Triton vs torch kernels",
        "try: kernel tiles in registers vs wide",
    },
    "routing": {"routed vs R(n)"},
    "memory": {"peak memory"},
    "training": {"training step"},
    "server": {"model bound", "decode bound", "server", "two keys"},
    "invariance": {"ops: alone == in batches of 2..32", "invariant vs default"},
    "profile": {"one pass, profiled"},
}


def test_cpu_smoke_of_all_steps_writes_one_report(tmp_path) -> None:
    assert main(["--all", "--cpu-smoke", "--out", str(tmp_path)]) == 0
    assert set(TABLES) == set(STEPS) == {part.step for part in ALL}
    # A lent machine returns at most 8 files: one JSON, one Markdown, the kept profile trace, the
    # server's log (one per server started; --all on a GPU starts two).
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["server-1.log", "suite.json", "suite.md", "trace-tiny-routed8-graphs-off.json.gz"]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert [s["step"] for s in suite["steps"]] == [part.step for part in ALL]
    assert {"device", "torch", "timm", "commit"} <= set(suite["env"]) and suite["env"]["device"] == "cpu"
    text = (tmp_path / "suite.md").read_text()
    for data in suite["steps"]:
        step = data["step"]
        assert data["status"] == "done", (step, data["notes"])
        assert TABLES[step] <= set(data["tables"]), step
        rows = [row for table in data["tables"].values() for row in table]
        assert rows and not [row for row in rows if "error" in row], step
        assert f"## {step} (done" in text and all(f"### {t}" in text for t in TABLES[step])
    tables = {data["step"]: data["tables"] for data in suite["steps"]}
    # Every answer under load checked against its photo's answer alone: here all right, all 200;
    # every process's CPU per image, the load generator's too.
    for row in tables["server"]["server"]:
        assert row["answers"] == {"200": row["right"]} and row["wrong or not 200"] == 0, row
        assert row["cpu ms/img server"] > 0 and row["cpu ms/img load generator"] > 0
    # The default's loads: full, paced at half, and a crowd of 4 x the clients (closed-loop)
    full, half, crowd = tables["server"]["server"]
    assert [r["load"] for r in (full, half, crowd)] == ["full", "half", "crowd"]
    assert crowd["clients"] == 4 * full["clients"]
    assert "offered img/s" in half and "offered img/s" not in crowd  # paced, then closed-loop again
    (keys,) = tables["server"]["two keys"]
    assert keys["light p50 ms beside"] > 0 and keys["wrong or not 200"] == 0
    # Goals sit next to their figures.
    assert all(row["goal <= 1.10"] in ("PASS", "MISS") for row in tables["engine"]["fused vs R(K)"])
    assert all(row["goal >= 2"] in ("PASS", "MISS") for row in tables["engine"]["dense reference"])
    assert all(row["invariant_holds"] for row in tables["invariance"]["invariant vs default"])
    # Triton (its interpreter, here) and torch kernels give the same logits.
    assert all(row["max diff"] < 1e-4 for row in tables["engine"]["try: Triton vs torch kernels"])
    assert all(row["max diff"] < 1e-4 for row in tables["engine"]["try: kernel tiles in registers vs wide"])
    profiled = tables["profile"]["one pass, profiled"]
    assert [row["pass"] for row in profiled] == [
        "base only", "fused, K = 8", "fused, K = 16",
        "routed, 1 of 16 per image", "routed, 8 of 16 per image",
    ]  # fmt: skip
    # No pass dispatches an op that would make a GPU wait for the host; adapters add aten ops.
    assert all(row["host syncs"] == 0 and row["kernels"] is None for row in profiled)
    assert profiled[0]["aten ops"] < profiled[1]["aten ops"]


def test_a_cut_off_command_keeps_finished_steps(tmp_path) -> None:
    # No budget left: the steps stop before their first measurement and say so; files are written.
    args = ["--cpu-smoke", "--steps", "routing,training,profile", "--budget-s", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    for step in ("routing", "training", "profile"):
        data = json.loads((tmp_path / f"{step}.json").read_text())
        assert data["status"] == "partial" and any("budget" in n for n in data["notes"])
        assert (tmp_path / f"{step}.md").read_text().startswith(f"# GPU suite: {step} (partial")


def plan_of(step: str) -> Plan:
    (part,) = [p for p in ALL if p.step == step]
    return Plan(device=Plan.smoke_plan().device).narrowed(**part.overrides)


def test_all_covers_the_goals_table_in_one_command() -> None:
    deit, b16 = "deit_tiny_patch16_224", "vit_base_patch16_224"
    assert ALL[0].step == "exactness"  # numbers first
    exact = plan_of("exactness")
    assert {deit, b16} <= set(exact.archs) and {"fp32", "bf16"} <= set(exact.dtypes)
    engine = plan_of("engine")
    assert {deit, b16} <= set(engine.archs) and "bf16" in engine.dtypes and not engine.large
    assert {64, 256} <= set(engine.batches) and {8, 64, 1000} <= set(engine.ks) and engine.dense_k == 64
    assert {"graphs", "kernels", "ahead", "tiles"} <= set(engine.tries)
    assert {deit, b16} <= set(engine.tries_on)
    routing = plan_of("routing")
    assert {64, 256} <= set(routing.batches) and routing.loaded == 1000 and {deit, b16} <= set(routing.archs)
    assert "bf16" in plan_of("invariance").dtypes
    profile = plan_of("profile")
    assert profile.archs[0] == deit and profile.dtypes[0] == "bf16" and profile.batches[0] == 64
    assert profile.loaded == 1000
    # Inside 9 minutes with the install and import check (~20 s). The estimates are the H200's
    # measured seconds (2026-11-28) with a few seconds each to spare; the budget keeps 8% over them
    # for a slow start, and a step that overruns is cut short (its rows so far kept), not the rest.
    assert sum(part.estimate_s for part in ALL) <= 0.92 * BUDGET_S and BUDGET_S + 30 <= 540
    assert profile.batches[:2] == (64, 256)  # the engine's goal: wall minus busy at both batches
    # Where every step takes its estimate, none is cut short by the reserves of the steps after it.
    for i, part in enumerate(ALL):
        before = sum(p.estimate_s for p in ALL[:i])
        assert BUDGET_S - before - sum(p.reserve_s for p in ALL[i + 1 :]) >= part.estimate_s, part.step
    server = plan_of("server")
    assert server.server_models == (deit, b16)  # ViT-B/16 served too (in bfloat16: server.py)
    (part,) = [p for p in ALL if p.step == "server"]
    assert part.reserve_s >= 3 * server.server_seconds + 60  # what server.py asks before a model


def event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_trace_summary_counts_per_pass() -> None:
    events = [
        event("user_annotation", "pass", 0, 15),
        event("cpu_op", "aten::linear", 0, 10),
        event("cpu_op", "aten::addmm", 1, 5),  # inside linear: the leaf
        event("cpu_op", "aten::add", 12, 1),
        event("cuda_runtime", "cudaLaunchKernel", 2, 1),
        event("cuda_driver", "cuLaunchKernelEx", 3, 1),  # Triton's launches
        event("user_annotation", "pass", 16, 4),
        event("cuda_runtime", "cudaGraphLaunch", 17, 1),
        event("cuda_runtime", "cudaStreamSynchronize", 18, 1),
        event("kernel", "gemm", 100, 10),
        event("kernel", "softmax", 105, 10),  # overlaps gemm: busy 100-115
        event("kernel", "add", 200, 5),
        event("gpu_memcpy", "Memcpy HtoD", 90, 2),
        event("cuda_runtime", "cudaDeviceSynchronize", 21, 5),  # the benchmark's own, after: not counted
        event("cpu_op", "aten::empty", 30, 1),  # outside every pass: not counted
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 2, "id": 1},
    ]
    got = summarize(events, 2, mark="pass", gpu=True)
    assert got == {
        "kernels": 1.5,
        "launch calls": 1.5,
        "graph launches": 0.5,
        "copies": 0.5,
        "host syncs": 0.5,
        "aten ops": 1.0,  # addmm and add
        "GPU busy ms": pytest.approx(0.01),  # (15 + 5) us over 2 passes
        "copy kinds": "Memcpy HtoD x0.5",
        "top kernels (us/pass)": "gemm 5; softmax 5; add 2",
    }
    cpu = [
        event("user_annotation", "pass", 0, 5),
        event("cpu_op", "aten::nonzero", 0, 2),
        event("cpu_op", "aten::mul", 3, 1),
    ]
    got = summarize(cpu, 1, mark="pass", gpu=False)
    assert got["host syncs"] == 1 and got["aten ops"] == 2 and got["kernels"] is None
    assert got["GPU busy ms"] is None


def test_import_check_passes_here_and_names_what_fails(capsys) -> None:
    assert imports.main(["--wheels", "/nonexistent"]) == 0
    assert "imports: ok" in capsys.readouterr().out
    failed = imports.import_all(("json", "no_such_module_here"))
    assert len(failed) == 1 and "no_such_module_here" in failed[0]


def test_import_check_holds_the_install_to_the_manifest() -> None:
    pins = {"timm": imports.installed_version("timm") or ""}
    good = {"pins": pins, "memvit_sources": wheels.source_digest()}
    assert imports.check_manifest(good) == []
    stale = {"pins": {**pins, "fastapi": "0.0.1"}, "memvit_sources": "0" * 64}
    failed = imports.check_manifest(stale)
    assert len(failed) == 2 and "fastapi" in failed[0] and "rerun benchmarks.gpu.prepare" in failed[1]


def test_import_check_warns_of_unmet_requirements() -> None:
    assert imports.check_requirements() == []
    old = {"fastapi": "0.1.0", "opentelemetry-api": None}
    unmet = imports.check_requirements(lambda name: old.get(name, imports.installed_version(name)))
    assert any(line.startswith("memvit needs fastapi") and "found 0.1.0" in line for line in unmet)
    assert any(line.startswith("fastapi needs opentelemetry-api") and "nothing" in line for line in unmet)


def test_import_check_runs_first_in_the_printed_command() -> None:
    from benchmarks.common import REPO
    from benchmarks.gpu.prepare import COMMAND, PREFIX

    assert "python3 -m benchmarks.gpu.imports --cuda || exit;" in PREFIX and COMMAND.startswith(PREFIX)
    assert PREFIX.index("pip install") < PREFIX.index("benchmarks.gpu.imports")
    assert COMMAND.endswith("python3 -m benchmarks.gpu --all 2>&1 | tee $OUT/suite.log")
    assert len(COMMAND) <= 2000  # what a device command may be
    docs = (REPO / "docs" / "gpu.md").read_text()
    assert f"\n{COMMAND}\n" in docs and 'carry: ["gpu-data", ".whl"]' in docs
