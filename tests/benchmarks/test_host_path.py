"""benchmarks/host_path.py runs (CI's smoke) and its counted goals hold: its timings mean little on a
busy CI machine and are not asserted."""

from __future__ import annotations

from benchmarks import host_path


def test_the_host_path_benchmark_runs_and_its_counts_meet_their_goals(capsys) -> None:
    rows = host_path.run([4], repeats=2)
    assert {r.case for r in rows} == {
        "base", "fused K=8", "fused K=64", "fused K=1000", "routed 1 of 1000", "routed 8 of 1000",
    }  # fmt: skip
    counted = [line for line in host_path.verdicts(rows) if not line.startswith("plan")]
    assert len(counted) == 4 and all("PASS" in line for line in counted), counted
