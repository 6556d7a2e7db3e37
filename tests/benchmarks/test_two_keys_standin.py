"""benchmarks/two_keys_standin.py: the engine loop in its GPU shape with the device's time as sleeps;
a light key's request waits behind the flood's batches, as on the H200 (its smoke, one short round)."""

from __future__ import annotations

from benchmarks.two_keys_standin import main


def test_smoke_the_flood_delays_the_light_key(capsys) -> None:
    ratio = main(["--smoke"])
    out = capsys.readouterr().out
    assert "light beside / alone" in out and "the flood" in out
    # sleeps of milliseconds, one decode and one pass at a time: the light request waits behind the
    # flood's batches (~4x on the build machine, 3.3x on the H200), far above what noise could make
    assert ratio > 1.5
