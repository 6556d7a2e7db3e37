"""benchmarks/front_end_cpu.py: its upload is a 95 KiB file that decodes to 32x32, and its smoke runs
(one process, a short round) and prints the table."""

from __future__ import annotations

import io

from PIL import Image

from benchmarks.front_end_cpu import UPLOAD_BYTES, main, padded_jpeg


def test_the_upload_is_a_photo_sized_file_of_a_tiny_picture() -> None:
    data = padded_jpeg()
    assert len(data) == UPLOAD_BYTES
    image = Image.open(io.BytesIO(data))
    assert image.format == "JPEG" and image.size == (32, 32)
    image.load()


def test_smoke(capsys) -> None:
    main(["--smoke", "--configs", "1", "--decode", "device"])
    table = capsys.readouterr().out.split("| config, decode |")[1]
    row = next(line for line in table.splitlines() if line.startswith("| 1 device |"))
    front, _, group = (cell.strip() for cell in row.split("|")[2:5])
    assert float(front) > 0 and front == group and row.rstrip().endswith("| 0 |")  # no non-200


def test_fresh_starts_every_server_anew_for_each_round(capsys, monkeypatch) -> None:
    import benchmarks.front_end_cpu as bench

    started = []

    def counting(*args, **kwargs):
        server = real(*args, **kwargs)
        started.append(server)
        return server

    real = bench.start
    monkeypatch.setattr(bench, "start", counting)
    main(["--configs", "1", "--decode", "device", "--rounds", "2", "--seconds", "1", "--fresh"])
    out = capsys.readouterr().out
    assert out.count("round 1 1 device:") == 1 and out.count("round 2 1 device:") == 1
    assert len(started) == 2 and started[0].proc.pid != started[1].proc.pid
    assert all(s.proc.poll() is not None for s in started)  # each stopped: the first before round 2
