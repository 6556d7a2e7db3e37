"""Hundreds of classify requests while adapters come and go: no 5xx, every answer from one snapshot."""

from __future__ import annotations

import io
import threading
from collections import defaultdict

import httpx
import torch
from PIL import Image

from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT
from memvit.server.settings import Settings
from tests.server.conftest import TOKEN, free_port, running_server

CLIENTS, REQUESTS_EACH = 8, 30  # 240 requests of 2 images


def _image() -> bytes:
    buf = io.BytesIO()
    Image.radial_gradient("L").resize((64, 64)).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def test_classify_during_registrations(tiny_weights, tmp_path, make_bundle) -> None:
    image = _image()
    stable = make_bundle("stable", m=2)
    flips = {"A": make_bundle("flip", m=1, seed=10), "B": make_bundle("flip", m=4, seed=11)}
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    x = eval_transform(engine)(to_rgb(Image.open(io.BytesIO(image))))[None]
    expected = {}
    with torch.no_grad():
        for key, bundle in [("stable", stable), *flips.items()]:
            expected[key] = engine(x, engine.prepare_set([bundle.weights])).adapters[bundle.name][0]

    settings = Settings(
        weights=tiny_weights,
        adapter_store=tmp_path / "store",
        port=free_port(),
        admin_token=TOKEN,
        max_batch=8,
        max_wait_ms=3,
        store_poll_seconds=0.1,
    )
    errors: list[str] = []
    responses: list[dict] = []
    stop = threading.Event()

    def classify_loop(url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(REQUESTS_EACH):
                files = [("image", ("a.png", image, "image/png")), ("image", ("b.png", image, "image/png"))]
                r = client.post("/classify", files=files, params={"logits": True})
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text}")
                else:
                    responses.append(r.json())

    def admin_loop(url: str) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, timeout=60, headers=auth) as client:
            i = 0
            while not stop.is_set():
                flip = flips["AB"[i % 2]]
                statuses = [
                    client.post(
                        "/adapters", params={"replace": True}, files={"bundle": ("f", flip.to_bytes())}
                    ).status_code,
                    client.post(
                        "/adapters", files={"bundle": ("h", make_bundle(f"hot-{i}", m=i % 3).to_bytes())}
                    ).status_code,
                    client.delete(f"/adapters/hot-{i}").status_code,
                ]
                if statuses != [201, 201, 200]:
                    errors.append(f"admin round {i}: {statuses}")
                i += 1

    with running_server(settings) as url:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert (
            httpx.post(
                f"{url}/adapters", files={"bundle": ("s", stable.to_bytes())}, headers=auth
            ).status_code
            == 201
        )
        admin = threading.Thread(target=admin_loop, args=(url,))
        clients = [threading.Thread(target=classify_loop, args=(url,)) for _ in range(CLIENTS)]
        admin.start()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        stop.set()
        admin.join()
        assert httpx.get(f"{url}/readyz").status_code == 200

    assert errors == []
    assert len(responses) == CLIENTS * REQUESTS_EACH
    flip_by_version: dict[int, set[str]] = defaultdict(set)
    for body in responses:
        computed = body["tasks"]
        first, second = body["results"]
        assert computed[0] == "base" and "stable" in computed
        for result in body["results"]:
            assert sorted(result["tasks"]) == sorted(computed)  # exactly the snapshot's tasks
        for task in first["tasks"]:  # both images of a request come from the same pass
            assert first["tasks"][task]["logits"] == second["tasks"][task]["logits"]
        assert torch.allclose(torch.tensor(first["tasks"]["stable"]["logits"]), expected["stable"], atol=1e-5)
        if "flip" in first["tasks"]:
            got = torch.tensor(first["tasks"]["flip"]["logits"])
            which = [k for k in "AB" if torch.allclose(got, expected[k], atol=1e-5)]
            assert len(which) == 1, "flip logits match neither registered version"
            flip_by_version[body["registry"]["version"]].add(which[0])
    assert all(len(v) == 1 for v in flip_by_version.values())  # one version, one set of weights
    assert len({k for v in flip_by_version.values() for k in v}) == 2  # both versions were served
