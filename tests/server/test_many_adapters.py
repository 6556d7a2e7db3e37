"""A thousand adapters: they load, /classify answers the one each request asks for from a routed pass,
and they hot-swap, over HTTP on a real server (tiny random models keep it fast)."""

from __future__ import annotations

import random

import httpx

from server.store import LocalStore
from tests.server.conftest import TOKEN, running_server
from tests.server.test_api import jpeg, post_image, register

COUNT = 1000


def test_a_thousand_adapters_load_serve_and_hot_swap(settings, store, make_bundle) -> None:
    local = LocalStore(store)
    for i in range(COUNT):
        local.write(
            f"t{i:04d}", make_bundle(f"t{i:04d}", m=i % 3, classes=2 + i % 4).to_bytes(), replace=False
        )
    with (
        running_server(settings) as url,
        httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client,
    ):
        listed = client.get("/adapters", params={"limit": 1}).json()
        assert len(listed["adapter_set"]["adapters"]) == COUNT and listed["invalid"] == {}
        rng = random.Random(0)
        for name in rng.sample([f"t{i:04d}" for i in range(COUNT)], 5):
            r = post_image(client, jpeg(), jpeg((0, 0, 255)), tasks=name, logits=True)
            assert r.status_code == 200, r.text
            for result in r.json()["results"]:
                assert list(result["tasks"]) == [name]
        # Hot swap: add, replace, delete with a thousand loaded; the answers follow.
        assert register(client, make_bundle("fresh", m=1, classes=3).to_bytes()).status_code == 201
        first = post_image(client, jpeg(), tasks="fresh", logits=True).json()
        replaced = register(client, make_bundle("fresh", m=2, classes=3, seed=7).to_bytes(), replace=True)
        assert replaced.status_code == 201
        second = post_image(client, jpeg(), tasks="fresh", logits=True).json()
        assert second["adapter_set"]["version"] > first["adapter_set"]["version"]
        assert (
            first["results"][0]["tasks"]["fresh"]["logits"]
            != second["results"][0]["tasks"]["fresh"]["logits"]
        )
        assert client.delete("/adapters/t0500").status_code == 200
        gone = post_image(client, jpeg(), tasks="t0500")
        assert gone.status_code == 422 and "t0500" in gone.json()["error"]["message"]
        assert len(client.get("/adapters").json()["adapter_set"]["adapters"]) == COUNT
