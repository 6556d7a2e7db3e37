"""A thousand adapters: registered, a hundred resident, /classify answers the one each request asks for
from a routed pass (loading it on demand, evicting the least recently used), and they hot-swap, over
HTTP on a real server (tiny random models keep it fast)."""

from __future__ import annotations

import random

import httpx

from memvit.server.store import LocalStore
from tests.server.conftest import TOKEN, published, running_server
from tests.server.filling import register_in_bulk
from tests.server.test_api import jpeg, post_image, register

COUNT = 1000
RESIDENT = 100


def test_a_thousand_adapters_load_serve_and_hot_swap(settings, store, make_bundle) -> None:
    names = [f"t{i:04d}" for i in range(COUNT)]
    bundles = [make_bundle(n, m=i % 3, classes=2 + i % 4) for i, n in enumerate(names)]
    register_in_bulk(LocalStore(store), [(b, b.to_bytes()) for b in bundles])
    settings = settings.model_copy(update={"resident_adapters": RESIDENT})
    with (
        running_server(settings) as url,
        httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client,
    ):
        listed = client.get("/adapters", params={"limit": 1}).json()
        assert listed["registry"] == {"version": COUNT, "adapters": COUNT} and listed["invalid"] == {}
        # Without a filter a registry this size is refused: the request says what it wants.
        r = post_image(client, jpeg())
        assert r.status_code == 400 and "name the tasks you want with ?tasks=" in r.json()["error"]["message"]
        rng = random.Random(0)
        asked = rng.sample(names, RESIDENT + 20)  # more than fit: the first ones are evicted
        first = {}
        for name in asked:
            r = post_image(client, jpeg(), jpeg((0, 0, 255)), tasks=name, logits=True)
            assert r.status_code == 200, r.text
            assert r.json()["tasks"] == [name]
            first[name] = r.json()["results"][0]["tasks"][name]["logits"]
        expected = [
            f"memvit_resident_adapters {float(RESIDENT)}",
            f'memvit_adapter_loads_total{{result="loaded"}} {float(len(asked))}',
        ]
        metrics = published(client, expected)
        assert all(line in metrics for line in expected), metrics
        # Evicted, loaded again: the same logits, bit for bit (the same images in the same batch shape).
        again = post_image(client, jpeg(), jpeg((0, 0, 255)), tasks=asked[0], logits=True).json()
        assert again["results"][0]["tasks"][asked[0]]["logits"] == first[asked[0]]
        # Several adapters in one request, base included.
        r = post_image(client, jpeg(), tasks=",".join(["base", *asked[:8]]))
        assert r.status_code == 200 and r.json()["tasks"] == ["base", *asked[:8]]
        # Hot swap: add, replace, delete with a thousand registered; the answers follow.
        assert register(client, make_bundle("fresh", m=1, classes=3).to_bytes()).status_code == 201
        first = post_image(client, jpeg(), tasks="fresh", logits=True).json()
        replaced = register(client, make_bundle("fresh", m=2, classes=3, seed=7).to_bytes(), replace=True)
        assert replaced.status_code == 201
        second = post_image(client, jpeg(), tasks="fresh", logits=True).json()
        assert second["registry"]["version"] > first["registry"]["version"]
        assert (
            first["results"][0]["tasks"]["fresh"]["logits"]
            != second["results"][0]["tasks"]["fresh"]["logits"]
        )
        assert client.delete("/adapters/t0500").status_code == 200
        gone = post_image(client, jpeg(), tasks="t0500")
        assert gone.status_code == 422 and "t0500" in gone.json()["error"]["message"]
        assert client.get("/adapters").json()["registry"]["adapters"] == COUNT
