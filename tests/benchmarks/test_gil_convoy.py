"""benchmarks/gil_convoy.py: its smoke run times the real decode stage alone and beside a saturated
event loop, and puts the process's switch interval back."""

from __future__ import annotations

import sys

from benchmarks.gil_convoy import jpegs, main


def test_its_jpegs_are_of_distinct_sizes() -> None:
    import io

    from PIL import Image

    sizes = {Image.open(io.BytesIO(item.data)).size for item in jpegs(17)}
    assert len(sizes) == 17


def test_the_smoke_run_prints_a_row_per_interval(capsys) -> None:
    before = sys.getswitchinterval()
    main(["--smoke"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "0.25"]
    assert all(float(row.split("|")[2]) > 0 for row in rows)
    assert sys.getswitchinterval() == before
