"""The serve benchmark's model-size uploads: the eval geometry at the model's input size, as JPEG."""

from __future__ import annotations

import io

from PIL import Image

from benchmarks.serve_measures import model_size_jpeg
from tests.conftest import tiny_engine


def test_model_size_uploads_are_jpegs_at_the_input_size_with_the_eval_crop() -> None:
    engine = tiny_engine()  # 32x32 inputs
    wide = Image.new("RGB", (300, 100), (0, 0, 255))
    wide.paste((255, 0, 0), (100, 0, 200, 100))  # the centre third red: what the centre crop keeps
    buf = io.BytesIO()
    wide.save(buf, format="PNG")
    out = Image.open(io.BytesIO(model_size_jpeg(engine, buf.getvalue())))
    assert out.format == "JPEG" and out.size == (32, 32)
    r, _, b = out.convert("RGB").getpixel((16, 16))
    assert r > 200 and b < 60
