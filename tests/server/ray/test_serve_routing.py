"""Adapter-aware routing on the Ray cluster: a request for an adapter goes to the replica that holds it.

Last of the cluster's tests (file order): it registers more adapters than an unfiltered request may
ask for."""

from __future__ import annotations

import io
from collections import Counter

import httpx
import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the ray extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")

from memvit.adapters import bundle_for  # noqa: E402
from memvit.adapters.preprocess import eval_transform, to_rgb  # noqa: E402
from memvit.memory_core import MemoryViT  # noqa: E402
from memvit.server.ray.affinity import KEY_HEADER  # noqa: E402
from memvit.server.ray.serve import REPLICA_HEADER  # noqa: E402
from tests.factories import random_adapter  # noqa: E402
from tests.server.conftest import TOKEN  # noqa: E402
from tests.server.ray.cluster import FIGURES, RESIDENT, TENANTS, Cluster  # noqa: E402


# -- adapter-aware routing (last: it registers more adapters than an unfiltered request may ask for) --
def _lookups(replicas: dict[str, dict]) -> dict[str, Counter]:
    return {r: Counter(info["lookups"]) for r, info in replicas.items()}


def test_requests_for_an_adapter_go_to_the_replica_that_holds_it(cluster: Cluster, tiny_weights) -> None:
    cluster.both_replicas()
    earlier = set(cluster.registered)
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    names = [f"tenant-{i:02d}" for i in range(TENANTS)]
    adapters = [random_adapter(name, engine, m=2, classes=5) for name in names]
    image = cluster.expected.images[0]
    x = eval_transform(engine)(to_rgb(Image.open(io.BytesIO(image)))).unsqueeze(0)
    with torch.inference_mode():
        expected = {n: t[0] for n, t in engine(x, engine.prepare_set(adapters)).adapters.items()}

    def check(r: httpx.Response, *tasks: str) -> str:
        assert r.status_code == 200, r.text
        got = r.json()["results"][0]["tasks"]
        for task in tasks:
            assert torch.allclose(torch.tensor(got[task]["logits"]), expected[task], atol=1e-4), task
        return r.headers[REPLICA_HEADER]

    def classify(client: httpx.Client, tasks: str, headers: dict[str, str] | None = None) -> httpx.Response:
        files = {"image": ("img.jpg", image, "image/jpeg")}
        params = {"logits": True, "tasks": tasks}
        return client.post(f"{cluster.url}/classify", files=files, params=params, headers=headers, timeout=20)

    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for adapter in adapters:
            bundle = bundle_for(adapter, engine).to_bytes()
            r = client.post(f"{cluster.url}/adapters", files={"bundle": ("b", bundle)}, timeout=30)
            assert r.status_code == 201, r.text
        served: dict[str, set[str]] = {name: set() for name in names}
        for name in names:  # the first round: each adapter loaded where it is sent (or already there)
            served[name].add(check(classify(client, name), name))
        after_first = _lookups(cluster.both_replicas())
        for _ in range(2):
            for name in names:
                served[name].add(check(classify(client, name), name))
        after = _lookups(cluster.both_replicas())
        # Each adapter went to one replica every time, and each replica serves a slice of them.
        assert all(len(replicas) == 1 for replicas in served.values()), served
        home = {name: next(iter(replicas)) for name, replicas in served.items()}
        slices = Counter(home.values())
        assert len(slices) == 2, f"one replica got every adapter: {slices}"
        # ... where it stayed resident: the repeats were all hits on a replica whose slice fits beside
        # the adapters registered before (resident there too, once an unfiltered request asked for
        # them; a slice that does not fit beside them thrashes the LRU). 10 tenants on 2 replicas: at
        # least one slice has 5 or fewer, so one is always checked.
        for replica, size in slices.items():
            if size + len(earlier) <= RESIDENT:
                assert after[replica] - after_first[replica] == Counter(hit=2 * size), (replica, size)

        a, b = (next(n for n in names if home[n] == replica) for replica in slices)
        # Several adapters: routed by the first one named, every answer right.
        assert check(classify(client, f"{a},{b}"), a, b) == home[a]
        assert check(classify(client, f"base,{b},{a}"), a, b) == home[b]
        # An explicit key overrides the one the request names.
        assert check(classify(client, a, {KEY_HEADER.decode(): b}), a) == home[b]
        # The Open Inference Protocol: model name = adapter.
        body = {"inputs": [{"name": "PIXELS", "datatype": "FP32", "shape": list(x.shape),
                            "data": x.flatten().tolist()}]}  # fmt: skip
        for name in (a, b):
            r = client.post(f"{cluster.url}/v2/models/{name}/infer", json=body, timeout=20)
            assert r.status_code == 200, r.text
            (output,) = r.json()["outputs"]
            assert torch.allclose(torch.tensor(output["data"]), expected[name], atol=1e-4)
            assert r.headers[REPLICA_HEADER] == home[name]
        # No adapter named: any replica (Serve's power of two choices).
        base_only: set[str] = set()
        for _ in range(30):
            base_only.add(check(classify(client, "base")))
            if len(base_only) == 2:
                break
        assert len(base_only) == 2, base_only
    FIGURES["affinity"] = {
        "slices": sorted(slices.values()),
        "misses_first_round": sum((after_first[r]["miss"] for r in after_first), 0),
    }
