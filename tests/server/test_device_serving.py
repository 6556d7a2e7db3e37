"""The server with its device path on (CPU stand-ins, real uvicorn, httpx): JPEGs decoded with their
batch (``MEMVIT_DECODE_DEVICE=device`` runs the GPU path's own code through torchvision's CPU
decoder), each request's stages in ``Server-Timing`` and ``memvit_stage_seconds``, and a pass that
runs out of device memory answered with 503 while the server keeps serving."""

from __future__ import annotations

import io
import json
import struct

import httpx
import pytest
import torch
from PIL import Image

from memvit.memory_core import MemoryViT
from memvit.server.http.app import create_app
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.images import ImageDecoder
from memvit.server.telemetry.stages import STAGES
from tests.server.conftest import TOKEN, running_server
from tests.server.inference.test_device_decode import broken_jpeg, jpeg, photo
from tests.server.test_api import post_image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _header(image: bytes) -> bytes:
    tensor = {
        "name": "IMAGE",
        "shape": [1],
        "datatype": "BYTES",
        "parameters": {"binary_data_size": 4 + len(image)},
    }
    return json.dumps({"inputs": [tensor], "outputs": [{"name": "base"}]}).encode()


def oip_body(image: bytes) -> bytes:
    """A binary-extension infer request: one encoded image (4-byte length, then its bytes)."""
    return _header(image) + struct.pack("<I", len(image)) + image


def oip_headers(image: bytes) -> dict[str, str]:
    return {"Inference-Header-Content-Length": str(len(_header(image)))}


def timings(response: httpx.Response) -> dict[str, float]:
    """The Server-Timing header as {stage: milliseconds}."""
    parts = [p.strip().split(";dur=") for p in response.headers["server-timing"].split(",")]
    return {name: float(ms) for name, ms in parts}


def test_jpegs_decoded_with_their_batch_answer_as_the_cpu_path(settings, tiny_weights, monkeypatch) -> None:
    settings = settings.model_copy(update={"decode_device": "device", "server_timing": True})
    on_device: list[str] = []
    decode = DeviceDecoder.decode_batch

    def spy(self, items):
        on_device.extend(item.name for item in items)
        return decode(self, items)

    monkeypatch.setattr(DeviceDecoder, "decode_batch", spy)
    uploads = [jpeg(photo(0)), png(photo(1)), jpeg(photo(2).convert("L"))]
    engine = MemoryViT.from_timm(weights=tiny_weights)
    cpu = ImageDecoder(engine, max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels)
    with torch.no_grad():
        expected = engine(torch.stack([cpu(b) for b in uploads])).base
    # In this process (the spy must see the decoder), whatever MEMVIT_TEST_API_PROCESSES says.
    with (
        running_server(settings, create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        r = post_image(client, *uploads, logits=True)
        assert r.status_code == 200, r.text
        served = torch.tensor([img["tasks"]["base"]["logits"] for img in r.json()["results"]])
        assert on_device == ["img0.jpg", "img2.jpg"]  # the JPEGs; the PNG was decoded on a CPU worker
        assert (served - expected).abs().max() <= 0.05  # the device decoder's input is within 2/255
        stages = timings(r)
        assert {"receive", "decode", "queue", "pass", "respond"} <= set(stages) <= set(STAGES)
        assert all(ms >= 0 for ms in stages.values())
        # A broken JPEG gets the CPU path's answer, and only its request fails.
        bad = post_image(client, broken_jpeg())
        assert bad.status_code == 400 and "server-timing" in bad.headers
        with pytest.raises(Exception) as on_cpu:
            cpu(broken_jpeg(), "image")
        assert bad.json()["error"]["message"].endswith(str(on_cpu.value).split(": ", 1)[-1])
        # The Open Inference Protocol's encoded images take the same path.
        oip = client.post(
            "/v2/models/base/infer", content=oip_body(uploads[0]), headers=oip_headers(uploads[0])
        )
        assert oip.status_code == 200, oip.text
        logits = torch.tensor(oip.json()["outputs"][0]["data"])
        assert (logits - served[0]).abs().max() <= 1e-4
        assert "pass" in timings(oip)
        metrics = client.get("/metrics").text
    for stage in ("receive", "decode", "queue", "pass", "respond"):
        assert f'memvit_stage_seconds_count{{stage="{stage}"}}' in metrics


def test_server_timing_is_opt_in(server) -> None:
    with httpx.Client(base_url=server, timeout=60) as client:
        r = post_image(client, jpeg(photo(3)))
        assert r.status_code == 200 and "server-timing" not in r.headers
        assert 'memvit_stage_seconds_count{stage="pass"} 1.0' in client.get("/metrics").text


def test_a_pass_out_of_device_memory_answers_503_and_the_server_keeps_serving(settings, monkeypatch) -> None:
    real = MemoryViT.forward
    full = {"on": False}

    def forward(self, x, *args, **kwargs):
        if full["on"]:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(MemoryViT, "forward", forward)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    app = create_app(settings)  # in this process: the injected failure is this process's
    with (
        running_server(settings, app) as url,
        httpx.Client(base_url=url, timeout=60, headers=headers) as client,
    ):
        full["on"] = True
        r = post_image(client, jpeg(photo(4)), jpeg(photo(5)))
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "ran out of memory" in r.json()["error"]["message"]
        full["on"] = False
        assert post_image(client, jpeg(photo(4))).status_code == 200
        assert client.get("/readyz").status_code == 200
