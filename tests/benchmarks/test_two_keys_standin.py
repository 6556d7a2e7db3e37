"""benchmarks/two_keys_standin.py: the engine loop in its GPU shape with the device's time as sleeps;
a light key's request waits behind the flood's batches, as on the H200 (its smoke, one short round),
and where its time goes, step by step."""

from __future__ import annotations

from benchmarks.stub_pass import stubbed_device_pass
from benchmarks.two_keys_standin import MARKS, breakdown, main
from memvit.memory_core import MemoryViT


def test_smoke_the_flood_delays_the_light_key(capsys) -> None:
    ratio = main(["--smoke"])
    out = capsys.readouterr().out
    assert "light beside / alone" in out and "the flood" in out
    assert all(step in out for step in MARKS[1:])  # the light request's steps, beside the flood
    # sleeps of milliseconds, one decode and one pass at a time: the light request waits behind the
    # flood's batches (~4x on the build machine, 3.3x on the H200), far above what noise could make
    assert ratio > 1.5
    assert MemoryViT._device_pass is not stubbed_device_pass  # the stub stayed on its own engine


def test_each_step_is_timed_from_the_one_before() -> None:
    marks = {name: [10.0 * k, 100.0 + 10.0 * k + (k % 2)] for k, name in enumerate(MARKS)}
    steps = breakdown(marks)
    assert list(steps) == list(MARKS[1:])
    # per request: 10 ms a step for the first, 10 +- 1 for the second; the median of the two
    assert [round(v, 6) for v in steps.values()] == [10_500.0, 9_500.0] * 3
