"""Mutated bundles over HTTP and in the store: never a 5xx, never a crash, the live set unchanged.

The same mutations as tests/adapters/bundle/test_reader_fuzz.py, posted to a real server, journaled in its
live store (as a damaged disk or a replica of another base would leave them), and found in a store
written before the journal when a replica first starts on it.
"""

from __future__ import annotations

import io
import random
import time

from PIL import Image

from memvit.server.registry import Catalog
from memvit.server.store import LocalStore
from tests.adapters.bundle.test_reader_fuzz import mutate
from tests.server.filling import entries_for

POSTED = 300
DROPPED = 60


def test_mutated_bundles_posted_answer_4xx_and_change_nothing(client, make_bundle) -> None:
    assert (
        client.post(
            "/adapters", files={"bundle": ("p.safetensors", make_bundle("first").to_bytes())}
        ).status_code
        == 201
    )
    good = make_bundle("new", m=2, classes=4, parent="first").to_bytes()
    before = client.get("/adapters").json()
    rng = random.Random(7)
    statuses: dict[int, int] = {}
    for case in range(POSTED):
        response = client.post("/adapters", files={"bundle": ("b.safetensors", mutate(good, rng))})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"case {case}: {response.status_code} {response.text[:300]}"
        if response.status_code == 201:  # a mutation that is still a valid bundle: take it back out
            assert client.delete(f"/adapters/{response.json()['adapter']['name']}").status_code == 200
    assert client.get("/adapters").json()["adapters"] == before["adapters"]
    assert sum(n for code, n in statuses.items() if 400 <= code < 500) > POSTED // 2, statuses


def test_mutated_bundles_journaled_in_a_live_store_are_refused_and_listed(client, store, make_bundle) -> None:
    """Journal entries naming bundles that do not validate here (damaged on disk after they were
    journaled, or written by a replica of another base): asking for one is a 422 naming the reason,
    never a 5xx; each is listed under ``invalid``; everything else keeps working. A file dropped into
    the live store is not a registration at all (only the journal registers): never read."""
    assert (
        client.post(
            "/adapters", files={"bundle": ("k.safetensors", make_bundle("keep").to_bytes())}
        ).status_code
        == 201
    )
    good = make_bundle("new", m=2, classes=4)
    rng = random.Random(11)
    mutated = [(good, mutate(good.to_bytes(), rng)) for _ in range(DROPPED)]
    entries = entries_for(LocalStore(store), mutated)
    catalog = Catalog(LocalStore(store))
    catalog.open(lambda *_: None, max_bytes=1)  # type: ignore[arg-type, return-value]
    for i, entry in enumerate(entries):  # each under its own name, with the hash of its bytes
        catalog.commit(lambda _state, e=entry, i=i: e._replace(name=f"fuzz{i}"))
    (store / "dropped.safetensors").write_bytes(good.to_bytes())
    time.sleep(1.0)  # five poll intervals of 0.2 s
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    png = png.getvalue()
    for i in range(DROPPED):
        answer = client.post("/classify", files={"image": ("p.png", png)}, params={"tasks": f"fuzz{i}"})
        assert answer.status_code == 422, answer.text
        assert f"adapter 'fuzz{i}' cannot be served here" in answer.json()["error"]["message"]
    body = client.get("/adapters").json()
    assert len([n for n in body["invalid"] if n.startswith("fuzz")]) == DROPPED
    assert "dropped" not in body["invalid"] and "dropped" not in [a["name"] for a in body["adapters"]]
    # Changes and classification still work with all of that in the store.
    assert (
        client.post(
            "/adapters", files={"bundle": ("x.safetensors", make_bundle("later").to_bytes())}
        ).status_code
        == 201
    )
    assert client.delete("/adapters/keep").status_code == 200
    answer = client.post("/classify", files={"image": ("p.png", png)})
    assert answer.status_code == 200 and set(answer.json()["results"][0]["tasks"]) == {"base", "later"}


def test_a_replica_starts_with_malformed_bundles_in_its_store(settings, store, make_bundle) -> None:
    import json
    import struct

    import httpx

    from tests.server.launcher import running_server

    store.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"memory": {"dtype": "F32", "shape": [1], "data_offsets": ["a", "b"]}}).encode()
    (store / "offsets.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (store / "deep.safetensors").write_bytes(mutate(make_bundle("deep").to_bytes(), _DeepOnly()))
    (store / "good.safetensors").write_bytes(make_bundle("good").to_bytes())
    with running_server(settings) as url:
        body = httpx.get(f"{url}/adapters", timeout=10).json()
    assert [a["name"] for a in body["adapters"]] == ["good"]
    assert set(body["invalid"]) == {"offsets", "deep"}


class _DeepOnly(random.Random):
    """A random source that always picks the deep-nesting mutation, in the header itself."""

    def randrange(self, *args, **kwargs):
        return 6 if args == (9,) else super().randrange(*args, **kwargs)

    def random(self):
        return 0.1
