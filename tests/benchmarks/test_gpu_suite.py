"""The GPU suite's CPU form: every step runs and writes its JSON and Markdown, so the suite cannot rot
between the rare hours a GPU is lent (docs/gpu.md)."""

from __future__ import annotations

import json

from benchmarks.gpu.__main__ import STEPS, main

TABLES = {
    "exactness": {"synthetic bases"},
    "engine": {"base only vs timm", "fused vs R(K)", "dense reference", "try: SDPA backend, base path"},
    "routing": {"routed vs R(n)"},
    "memory": {"peak memory"},
    "training": {"training step"},
    "server": {"model bound", "decode bound", "server"},
    "invariance": {"ops: alone == in batches of 2..32", "invariant vs default"},
}


def test_cpu_smoke_writes_every_step(tmp_path) -> None:
    assert main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    assert set(TABLES) == set(STEPS)
    for step, tables in TABLES.items():
        data = json.loads((tmp_path / f"{step}.json").read_text())
        assert data["step"] == step and data["status"] == "done", data["notes"]
        assert {"device", "torch", "timm", "commit"} <= set(data["env"]) and data["env"]["device"] == "cpu"
        assert tables <= set(data["tables"]), step
        rows = [row for table in data["tables"].values() for row in table]
        assert rows and not [row for row in rows if "error" in row], step
        text = (tmp_path / f"{step}.md").read_text()
        assert text.startswith(f"# GPU suite: {step} (done") and all(f"## {t}" in text for t in tables)
    # Goals sit next to their figures.
    engine = json.loads((tmp_path / "engine.json").read_text())["tables"]
    assert all(row["goal <= 1.10"] in ("PASS", "MISS") for row in engine["fused vs R(K)"])
    invariance = json.loads((tmp_path / "invariance.json").read_text())["tables"]["invariant vs default"]
    assert all(row["invariant_holds"] for row in invariance)  # the mode holds in every dtype here


def test_a_cut_off_command_keeps_finished_steps(tmp_path) -> None:
    # No budget left: the steps stop before their first measurement and say so; files are written.
    args = ["--cpu-smoke", "--steps", "routing,training", "--budget-s", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    for step in ("routing", "training"):
        data = json.loads((tmp_path / f"{step}.json").read_text())
        assert data["status"] == "partial" and any("budget" in n for n in data["notes"])
