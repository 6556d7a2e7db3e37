"""The Open Inference Protocol, driven by the real tritonclient against a real server: metadata, infer
with JSON and with binary data, the classification extension, and logits equal to /classify's."""

from __future__ import annotations

import json
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest

from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT
from tests.server.conftest import TOKEN
from tests.server.test_api import jpeg, post_image, register

http = pytest.importorskip("tritonclient.http", reason="tritonclient is not installed (the dev extra has it)")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def triton(server):
    with http.InferenceServerClient(urlparse(server).netloc, network_timeout=30.0) as client:
        yield client


@pytest.fixture
def with_adapters(client, make_bundle):
    for name in ("cats", "dogs"):
        assert register(client, make_bundle(name).to_bytes()).status_code == 201
    return ["cats", "dogs"]


def classify_logits(client, image: bytes, tasks: list[str]) -> dict[str, list[float]]:
    return classify_batch(client, [image], tasks)[0]


def classify_batch(client, images: list[bytes], tasks: list[str]) -> list[dict[str, list[float]]]:
    """Per image, each task's logits from /classify (the images in one request: one batch, as the
    protocol's request is, so that the float reductions match; docs/design.md §2.6)."""
    r = post_image(client, *images, logits="true", tasks=",".join(tasks))
    assert r.status_code == 200, r.text
    return [{task: a["logits"] for task, a in result["tasks"].items()} for result in r.json()["results"]]


def image_input(*images: bytes, binary: bool = True):
    tensor = http.InferInput("IMAGE", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object), binary_data=binary)
    return tensor


def test_health_metadata_and_repository(triton, with_adapters, tiny_weights) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata()
    assert meta["name"] == "memvit" and "binary_tensor_data" in meta["extensions"]
    index = triton.get_model_repository_index()
    assert [m["name"] for m in index] == ["base", "cats", "dogs"] and all(
        m["state"] == "READY" for m in index
    )
    base = triton.get_model_metadata("base")
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    size = list(engine.spec.img_size)
    assert {i["name"]: (i["datatype"], i["shape"]) for i in base["inputs"]} == {
        "IMAGE": ("BYTES", [-1]),
        "PIXELS": ("FP32", [-1, 3, *size]),
    }
    assert [o["name"] for o in base["outputs"]] == ["base", "cats", "dogs"]
    assert base["outputs"][0]["shape"] == [-1, engine.base.num_classes]
    cats = triton.get_model_metadata("cats")
    assert cats["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}] or (
        cats["outputs"][0]["name"] == "logits" and cats["outputs"][0]["datatype"] == "FP32"
    )
    assert triton.is_model_ready("cats") and not triton.is_model_ready("nope")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json-outputs"])
def test_infer_equals_classify_bit_for_bit(triton, client, with_adapters, binary) -> None:
    images = [jpeg((200, 30, 30)), jpeg((20, 160, 90), size=(64, 30))]
    outputs = [http.InferRequestedOutput(name, binary_data=binary) for name in ("base", "dogs")]
    result = triton.infer("base", [image_input(*images)], outputs=outputs)
    assert set(result.get_response()["outputs"][i]["name"] for i in range(2)) == {"base", "dogs"}
    for i, expected in enumerate(classify_batch(client, images, ["base", "dogs"])):
        for task in ("base", "dogs"):
            got = result.as_numpy(task)[i]
            assert got.dtype == np.float32
            assert np.array_equal(got, np.asarray(expected[task], dtype=np.float32)), task


def test_an_adapter_is_a_model_and_pixels_are_an_input(triton, client, with_adapters, tiny_weights) -> None:
    image = jpeg((90, 90, 250))
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    import io

    from PIL import Image

    pixels = eval_transform(engine)(to_rgb(Image.open(io.BytesIO(image))))[None].numpy()
    tensor = http.InferInput("PIXELS", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels.astype(np.float32), binary_data=False)  # all-JSON request
    by_pixels = triton.infer("cats", [tensor]).as_numpy("logits")
    by_image = triton.infer("cats", [image_input(image)]).as_numpy("logits")
    expected = np.asarray(classify_logits(client, image, ["cats"])["cats"], dtype=np.float32)
    assert np.array_equal(by_image[0], expected)
    # The same pixels /classify computes from the same image, in a batch of one as here: bit for bit.
    assert np.array_equal(by_pixels[0], expected)


def test_classification_extension(triton, client, with_adapters) -> None:
    image = jpeg()
    result = triton.infer(
        "base", [image_input(image)], outputs=[http.InferRequestedOutput("cats", class_count=2)]
    )
    top = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("cats")[0]]
    logits = classify_logits(client, image, ["cats"])["cats"]
    order = np.argsort(-np.asarray(logits, dtype=np.float32), kind="stable")[:2]
    assert [int(entry.split(":")[1]) for entry in top] == [int(i) for i in order]
    assert all(len(entry.split(":")) == 3 for entry in top)  # value:index:label, as Triton formats it


def test_errors_are_in_the_protocols_shape(server, triton, with_adapters) -> None:
    with pytest.raises(InferenceServerException, match="no model named 'nope'") as unknown:
        triton.infer("nope", [image_input(jpeg())])
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException, match=r"unknown task") as bad_output:
        triton.infer("base", [image_input(jpeg())], outputs=[http.InferRequestedOutput("nope")])
    assert bad_output.value.status() in ("400", "422")
    with httpx.Client(base_url=server, timeout=30) as raw:
        for body, headers in [
            (b"not json", {}),
            (json.dumps({"inputs": []}).encode(), {}),
            (json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                    "parameters": {"binary_data_size": 99}}]}).encode(), {}),
            (b'{"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1]}]}', {}),
            (json.dumps({"inputs": [{"name": "PIXELS", "datatype": "FP32", "shape": [1, 3, 2, 2],
                                    "data": [0.0] * 12}]}).encode(), {}),
            (json.dumps({"inputs": [{"name": "X", "datatype": "INT8", "shape": [1],
                                    "data": [1]}]}).encode(), {}),
            (b"{}", {"Inference-Header-Content-Length": "999"}),
        ]:  # fmt: skip
            r = raw.post("/v2/models/base/infer", content=body, headers=headers)
            assert r.status_code == 400, (body, r.text)
            assert isinstance(r.json()["error"], str) and r.json()["error"]
        broken = json.dumps(
            {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["xx"]}]}
        )
        r = raw.post("/v2/models/base/infer", content=broken.encode())
        assert 400 <= r.status_code < 500 and isinstance(r.json()["error"], str)
        r = raw.get("/v2/models/nope")
        assert r.status_code == 404 and isinstance(r.json()["error"], str)


def test_too_many_images_and_the_body_cap(server, with_adapters) -> None:
    with http.InferenceServerClient(urlparse(server).netloc) as triton:
        images = [jpeg()] * 17  # the default limit is 16 per request
        with pytest.raises(InferenceServerException) as too_many:
            triton.infer("base", [image_input(*images)])
        assert too_many.value.status() == "413"
