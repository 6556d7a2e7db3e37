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
