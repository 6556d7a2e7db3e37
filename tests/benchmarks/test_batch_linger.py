"""benchmarks/batch_linger.py: a short run (one process, one client) prints a row per setting."""

from __future__ import annotations

from benchmarks.batch_linger import main


def test_smoke(capsys) -> None:
    main(["--configs", "1", "--clients", "1", "--seconds", "0.5", "--rounds", "1"])
    table = capsys.readouterr().out.split("| clients |")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["0", "2"]
    for row in rows:
        p50, p99, rate, cpu = (float(cell) for cell in row.split("|")[3:7])
        assert 0 < p50 <= p99 and rate > 0 and cpu > 0
