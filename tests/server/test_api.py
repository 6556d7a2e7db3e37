"""Every endpoint against a real uvicorn server, and every bad request: a clear 4xx, nothing lost."""

from __future__ import annotations

import io
import re
import time

import httpx
import pytest
import torch
from PIL import Image

from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT
from tests.adapters.bundle.test_format import BAD
from tests.server.conftest import TOKEN, photo, published


def jpeg(colour=(200, 30, 30), size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="JPEG")
    return buf.getvalue()


def post_image(client, *images: bytes, **params) -> httpx.Response:
    files = [("image", (f"img{i}.jpg", data, "image/jpeg")) for i, data in enumerate(images)]
    return client.post("/classify", files=files, params=params)


def register(client, bundle_bytes: bytes, **params) -> httpx.Response:
    return client.post("/adapters", files={"bundle": ("b.safetensors", bundle_bytes)}, params=params)


def snapshot(client, store) -> tuple:
    """What must not change after a refused request: the registry and the store's files and bytes."""
    registry = client.get("/adapters").json()["registry"]
    files = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    return registry, files


def bundle_files(store, name: str) -> list:
    """The bundle objects stored for adapter ``name`` (one per registration still referenced)."""
    return sorted((store / "bundles" / name).glob("*.safetensors"))


def test_health_ready_metrics_docs(client) -> None:
    assert client.get("/healthz").json() == {"status": "alive", "detail": None}
    assert client.get("/readyz").status_code == 200
    assert "/classify" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200
    post_image(client, jpeg())
    text = client.get("/metrics").text
    for metric in (
        "memvit_requests_total",
        "memvit_request_seconds_bucket",
        "memvit_batch_images_bucket",
        "memvit_queue_images",
        "memvit_adapters_loaded",
        "memvit_fused_pass_seconds_bucket",
    ):
        assert metric in text, metric
    assert 'route="/classify"' in text
    # torch, the model and the server, loaded once: out of the collector's reach (freeze_heap)
    frozen = re.search(r"^memvit_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen is not None and float(frozen.group(1)) > 50_000
    assert 'memvit_cuda_graph_captures{where="in a batch\'s way"} 0.0' in text  # a CPU captures none


def test_classify_one_and_many_with_filters(client, make_bundle) -> None:
    assert register(client, make_bundle("colours", m=2, classes=3).to_bytes()).status_code == 201
    r = post_image(client, jpeg())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tasks"] == ["base", "colours"] and body["registry"]["adapters"] == 1
    (result,) = body["results"]
    assert set(result["tasks"]) == {"base", "colours"}
    assert len(result["tasks"]["base"]["predictions"]) == 5
    assert result["tasks"]["colours"]["predictions"][0]["label"].startswith("colours-")
    probs = [p["probability"] for p in result["tasks"]["colours"]["predictions"]]
    assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-5  # 3 classes: all of them

    r = post_image(
        client, jpeg(), jpeg((0, 0, 255)), jpeg((0, 255, 0)), top_k=2, tasks="colours", logits=True
    )
    body = r.json()
    assert [x["image"] for x in body["results"]] == ["img0.jpg", "img1.jpg", "img2.jpg"]
    for result in body["results"]:
        assert list(result["tasks"]) == ["colours"]
        assert len(result["tasks"]["colours"]["predictions"]) == 2
        assert len(result["tasks"]["colours"]["logits"]) == 3
    r = client.post(
        "/classify",
        files=[("image", ("a.jpg", jpeg(), "image/jpeg"))],
        params=[("tasks", "base"), ("tasks", "colours")],
    )
    assert list(r.json()["results"][0]["tasks"]) == ["base", "colours"]
    # Per-task counters: 1 + 1 + 1 requests asked for colours (1 + 3 + 1 images), base 1 + 1 (1 + 1).
    expected = [
        'memvit_task_requests_total{task="colours"} 3.0',
        'memvit_task_images_total{task="colours"} 5.0',
        'memvit_task_images_total{task="base"} 2.0',
    ]
    metrics = published(client, expected)
    assert all(line in metrics for line in expected), metrics


def test_preprocessing_matches_memvit_eval(client, tiny_weights) -> None:
    data = photo("hopper_orientation_6.jpg")
    served = post_image(client, data, logits=True).json()["results"][0]["tasks"]["base"]["logits"]
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    x = eval_transform(engine)(to_rgb(Image.open(io.BytesIO(data))))
    with torch.no_grad():
        local = engine(x[None]).base[0]
    assert torch.allclose(torch.tensor(served), local, atol=1e-5)


@pytest.mark.parametrize(
    "make_request,status,message",
    [
        (lambda c: post_image(c, photo("truncated_image.png")), 400, "truncated"),
        (lambda c: post_image(c, b""), 400, "the file is empty"),
        (lambda c: post_image(c, b"GIF89a but not really"), 400, "a damaged or truncated GIF file"),
        (lambda c: post_image(c, photo("hopper.png")[:100]), 400, "a damaged or truncated PNG file"),
        (lambda c: post_image(c, b"just some text, no image here"), 415, "not an image"),
        (lambda c: post_image(c, jpeg(), tasks="nope"), 422, "unknown task(s) ['nope']"),
        (lambda c: post_image(c, jpeg(), top_k=0), 422, "top_k"),
        (lambda c: post_image(c, *[jpeg()] * 17), 413, "17 images in one request; the limit is 16"),
        (lambda c: c.post("/classify", json={"image": "x"}), 415, "expected a multipart/form-data upload"),
        (lambda c: c.post("/classify", files={"picture": ("a.jpg", jpeg())}), 422, "image: Field required"),
        (lambda c: c.get("/classify"), 405, "Method Not Allowed"),
        (lambda c: c.get("/nowhere"), 404, "Not Found"),
    ],
)
def test_bad_classify_requests(client, store, make_request, status, message) -> None:
    before = snapshot(client, store)
    r = make_request(client)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert client.get("/readyz").status_code == 200
    assert snapshot(client, store) == before


def test_register_describe_replace_delete(client, store, make_bundle) -> None:
    r = register(client, make_bundle("pets", m=1, classes=4).to_bytes())
    assert r.status_code == 201 and r.json()["replaced"] is False
    assert r.json()["adapter"]["memory_tokens"] == 1 and len(bundle_files(store, "pets")) == 1
    assert client.get("/adapters/pets").json()["num_classes"] == 4
    r = register(client, make_bundle("pets", m=3, classes=4, seed=1).to_bytes())
    assert r.status_code == 409 and "already registered" in r.json()["error"]["message"]
    r = register(client, make_bundle("pets", m=3, classes=4, seed=1).to_bytes(), replace=True)
    assert r.status_code == 201 and r.json()["replaced"] is True
    assert client.get("/adapters/pets").json()["memory_tokens"] == 3
    assert len(bundle_files(store, "pets")) == 1  # the replaced bundle's object is collected
    assert register(client, make_bundle("kid", m=1, parent="pets").to_bytes()).status_code == 201
    r = client.delete("/adapters/pets")
    assert r.status_code == 409 and "extend it" in r.json()["error"]["message"]
    assert client.delete("/adapters/kid").status_code == 200
    r = client.delete("/adapters/pets")
    assert r.status_code == 200 and r.json()["registry"]["adapters"] == 0
    assert bundle_files(store, "pets") == []
    assert client.get("/adapters/pets").status_code == 404
    assert client.delete("/adapters/pets").status_code == 404
    assert client.get("/adapters/..%2Fetc").status_code in (404, 422)
    assert client.get("/adapters/Bad Name").status_code == 422


def test_admin_token_is_required(server, make_bundle, store) -> None:
    data = make_bundle("locked").to_bytes()
    with httpx.Client(base_url=server) as anonymous:
        r = anonymous.post("/adapters", files={"bundle": ("b", data)})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = anonymous.post(
            "/adapters", files={"bundle": ("b", data)}, headers={"Authorization": "Bearer nope"}
        )
        assert r.status_code == 403
        r = anonymous.delete("/adapters/locked", headers={"Authorization": "Basic " + TOKEN})
        assert r.status_code == 401
        assert anonymous.get("/adapters").status_code == 200  # reading needs no token
    assert list(store.rglob("*.safetensors")) == []


# The registry checks names and parents against every registered adapter, resident or not, and says so.
REGISTRY_MESSAGES = {
    "duplicate name": "'first' is already registered",
    "missing parent": "extends 'ghost', which is not registered",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_bad_bundle_is_refused_and_nothing_changes(client, store, make_bundle, case) -> None:
    assert register(client, make_bundle("first", m=2).to_bytes()).status_code == 201
    make, _, message = BAD[case]
    message = REGISTRY_MESSAGES.get(case, message)
    data = make(make_bundle("new", m=3, classes=5))
    before = snapshot(client, store)
    r = register(client, data)
    assert 400 <= r.status_code < 500, r.text
    assert r.status_code == (409 if case in ("missing parent", "duplicate name") else 422)
    assert message in r.json()["error"]["message"]
    assert snapshot(client, store) == before
    assert client.get("/readyz").status_code == 200
    assert list(store.rglob("*.tmp")) == []  # no temp file left behind


def test_bundle_upload_limits(tiny_weights, store, make_bundle) -> None:
    from memvit.server.settings import Settings
    from tests.server.conftest import free_port, running_server

    settings = Settings(
        weights=tiny_weights, adapter_store=store, port=free_port(), max_bundle_bytes=1000, admin_token=TOKEN
    )
    admin = {"Authorization": f"Bearer {TOKEN}"}
    with running_server(settings) as url, httpx.Client(base_url=url, headers=admin) as client:
        r = register(client, make_bundle("big", m=5).to_bytes())
        assert r.status_code == 413 and "1000-byte upload limit" in r.json()["error"]["message"]
        r = client.post("/adapters", json={"bundle": "x"})
        assert r.status_code == 415


def test_every_real_format_classifies_over_http(client) -> None:
    from tests.server.inference.test_images import GOOD

    for i in range(0, len(GOOD), 8):  # a batch per request: 19 files, at most 16 images a request
        names = GOOD[i : i + 8]
        files = [("image", (name, photo(name), "application/octet-stream")) for name in names]
        r = client.post("/classify", files=files, params={"top_k": 1})
        assert r.status_code == 200, r.text
        assert [x["image"] for x in r.json()["results"]] == names


def test_image_byte_and_pixel_caps_over_http(tiny_weights, store) -> None:
    from memvit.server.settings import Settings
    from tests.server.conftest import free_port, running_server

    settings = Settings(
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        max_image_bytes=50_000,
        max_image_pixels=1_000_000,
        max_images_per_request=64,  # the request's cap (64 x 50 kB) lets the 1.8 MB photo reach its own
    )
    bomb = io.BytesIO()
    Image.new("L", (2000, 2000)).save(bomb, format="PNG")  # ~8 kB on the wire, 4 Mpx once decoded
    with running_server(settings) as url, httpx.Client(base_url=url) as client:
        r = post_image(client, photo("xmp_test.jpg"))  # 1.8 MB
        assert r.status_code == 413 and "over the 50000-byte upload limit" in r.json()["error"]["message"]
        r = post_image(client, bomb.getvalue())
        assert r.status_code == 413
        assert "4000000 pixels is over the 1000000-pixel limit" in r.json()["error"]["message"]
        assert post_image(client, jpeg()).status_code == 200  # still serving
        assert client.get("/readyz").status_code == 200


def test_the_adapter_list_pages_by_name(settings, store, make_bundle) -> None:
    """Pages of the registry by name, each with the invalid objects in its name range. The invalid
    ones come from a store written before the journal (a file dropped into a live store is not a
    registration: only the journal registers), migrated on start."""
    from tests.server.conftest import running_server

    store.mkdir(parents=True)
    for name in ("e", "a", "d", "b", "c"):
        (store / f"{name}.safetensors").write_bytes(make_bundle(name).to_bytes())
    (store / "bb.safetensors").write_bytes(b"not a bundle")  # invalid: listed in its page's range
    (store / "zz.safetensors").write_bytes(b"not a bundle")
    with running_server(settings) as url, httpx.Client(base_url=url) as client:
        pages, after = [], None
        while True:
            params = {"limit": 2, **({"after": after} if after else {})}
            body = client.get("/adapters", params=params).json()
            pages.append(([a["name"] for a in body["adapters"]], sorted(body["invalid"])))
            assert body["registry"]["adapters"] == 5  # the whole registry's count, every page
            if body["next"] is None:
                break
            after = body["next"]
        assert pages == [(["a", "b"], []), (["c", "d"], ["bb"]), (["e"], ["zz"])]
        assert client.get("/adapters", params={"limit": 0}).status_code == 422
        assert client.get("/adapters", params={"limit": 1001}).status_code == 422
        everything = client.get("/adapters").json()
        assert [a["name"] for a in everything["adapters"]] == ["a", "b", "c", "d", "e"]
        assert everything["next"] is None and everything["max_tasks_per_request"] == 64
        assert all(a["training"] is None for a in everything["adapters"])  # lists read no bundle


def test_a_damaged_journal_entry_refuses_changes_and_keeps_serving(client, store, make_bundle) -> None:
    """Never skipped (the replicas would disagree on what a version holds): the replica says so in
    /readyz, answers changes 503, and serves what it knows until an operator repairs the entry."""
    assert register(client, make_bundle("kept").to_bytes()).status_code == 201
    version = client.get("/adapters").json()["registry"]["version"]
    (store / ".journal" / f"{version + 1:016d}.json").write_bytes(b"{not json")
    for _ in range(50):  # the next poll finds it
        detail = client.get("/readyz").json()["detail"]
        if "damaged" in detail:
            break
        time.sleep(0.1)
    assert "is damaged" in detail and client.get("/readyz").status_code == 200
    r = register(client, make_bundle("new").to_bytes())
    assert r.status_code == 503 and "changes are refused until it is repaired" in r.json()["error"]["message"]
    assert post_image(client, jpeg(), tasks="kept").status_code == 200
