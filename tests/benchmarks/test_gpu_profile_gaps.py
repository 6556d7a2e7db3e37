"""The profile step's split of a pass's wall time beyond its kernels (benchmarks/gpu/profiling.py
``gap_parts``), on a hand-made trace: the host's time to the first launch, the device's own gaps."""

from __future__ import annotations

import pytest

from benchmarks.gpu.profiling import PASS_MARK, _against_base, gap_parts


def _pass(start: float, plan_us: float, correlation: int) -> list[dict]:
    """One pass: a copy, then a graph launch ``plan_us`` in; the copy's memcpy, then two kernels and
    a memset with a 3 us gap before the memset and 1 us after it."""
    launch_at = start + plan_us
    copy, graph = {"correlation": correlation}, {"correlation": correlation + 1}

    def event(cat: str, name: str, ts: float, dur: float, args: dict) -> dict:
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    return [
        {"cat": "user_annotation", "name": PASS_MARK, "ts": start, "dur": plan_us + 50},
        event("cuda_runtime", "cudaMemcpyAsync", start + 5, 5, copy),
        event("cuda_runtime", "cudaGraphLaunch", launch_at, 10, graph),
        event("gpu_memcpy", "Memcpy HtoD", launch_at, 2, copy),
        event("kernel", "k1", launch_at + 2, 100, graph),
        event("gpu_memset", "Memset", launch_at + 105, 1, graph),
        event("kernel", "k2", launch_at + 107, 100, graph),
    ]


def test_gap_parts_split_the_host_before_the_launch_from_the_device_gaps() -> None:
    events = _pass(0.0, 40.0, 1) + _pass(1000.0, 60.0, 3) + _pass(2000.0, 50.0, 5)
    parts = gap_parts(events)
    assert parts["host to launch ms"] == pytest.approx(0.050)  # the median pass's 50 us
    assert parts["device gaps ms"] == pytest.approx(0.004)  # 3 us before the memset, 1 after
    # each pass from its start to its last device work's end (plan + 207 us) less its kernels' 200
    assert parts["wall - busy ms, same pass"] == pytest.approx(0.057)
    assert set(gap_parts([]).values()) == {None}


def test_the_goal_reads_wall_minus_busy_from_the_same_passes() -> None:
    base = _against_base({"wall - busy ms": 0.5, "wall - busy ms, same pass": 0.20}, None)
    row = {"wall - busy ms": 0.2, "wall - busy ms, same pass": 0.27}
    assert base == 0.20 and _against_base(row, base) == 0.20
    assert row["over base's ms"] == pytest.approx(0.07) and row["goal <= 0.05"] == "MISS"
    cpu = {"wall - busy ms": None, "wall - busy ms, same pass": None}  # no busy time: no verdict
    assert _against_base(cpu, base) is None and "goal <= 0.05" not in cpu
