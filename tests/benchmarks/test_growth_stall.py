"""benchmarks/growth_stall.py: one round of each mode on the stand-in graphs. The server's way
(``ahead``) answers requests while the install captures, the batcher's answers none until its
captures are done; the report gives both modes and the ratio."""

from __future__ import annotations

from benchmarks.growth_stall import main, one_round


def test_the_install_captures_beside_serving_only_ahead() -> None:
    ahead = one_round("ahead", capture_s=0.005, add=20, clients=2, settle_s=0.2)
    batcher = one_round("batcher", capture_s=0.005, add=20, clients=2, settle_s=0.2)
    assert ahead["install s"] > batcher["install s"]  # the captures are the install's now
    assert ahead["answered during install"] > 0
    assert set(ahead) == set(batcher) and all(v >= 0 for v in (*ahead.values(), *batcher.values()))


def test_the_report(capsys) -> None:
    main(["--rounds", "1", "--capture-ms", "1", "--clients", "2", "--settle-s", "0.2"])
    out = capsys.readouterr().out
    assert "| median | ahead |" in out and "| median | batcher |" in out
    assert out.count("batcher / ahead = ") == 2  # growth, first use
