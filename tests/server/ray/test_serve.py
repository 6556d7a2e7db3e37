"""memvit on a real two-node Ray cluster on this machine (server/ray/serve.py, docker/ray/).

One cluster for the package (conftest.py), shared by its tests in file order: a head and a second
node, each ``ray start --block`` in its own session on a loopback address, one ``memvit_slot``
resource each so the two replicas land one per node; the shipped Serve config
(docker/ray/serve-config.yaml, adjusted for ports, resources and the test bucket) deployed with
``serve run``; a bucket on the S3 test server as the registry the replicas share. Every answer the
tests get is checked against logits computed here.

Losses happen under load (CLIENTS threads classifying through the proxy) and with requests the lost
replica is known to hold (bodies stopped halfway, placed by each replica's count of requests in
flight), so the 503 + Retry-After for a request lost mid-flight is checked every time, not by luck.
Every test needs only what the fixture sets up (the cluster, with ADAPTER registered), not what an
earlier test did: a test run alone (``-k``, ``--lf``) or on a pytest-xdist worker that did not get
the earlier tests (each worker builds its own cluster) checks the same things. Figures (start-up,
recovery, 503s) are logged when the cluster stops.
"""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the ray extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")

from memvit.server.ray.serve import REPLICA_HEADER  # noqa: E402
from tests.server.ray.cluster import CONFIG, FIGURES, LATE_ADAPTER, POLL_SECONDS, Cluster, _classify  # noqa: E402


# -- the config files (no cluster) -----------------------------------------------------------------
def test_the_serve_config_is_valid_and_the_rayservice_embeds_it() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "memvit.server.ray.serve:app"
    assert app.runtime_env["env_vars"]["MEMVIT_ADAPTER_STORE"].startswith("s3://")
    # The proxies listen on every interface: the replicas' Host check follows (server/edge/origin.py).
    assert app.runtime_env["env_vars"]["MEMVIT_HOST"] == config["http_options"]["host"] == "0.0.0.0"
    service = yaml.safe_load((CONFIG.parent / "rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == config, (
        "rayservice.yaml and serve-config.yaml differ"
    )
    # The image's Ray and the one tested here: the same minor version (pyproject's bound).
    assert service["spec"]["rayClusterConfig"]["rayVersion"].split(".")[:2] == ray.__version__.split(".")[:2]


# -- the cluster tests, in order -------------------------------------------------------------------
def test_classify_through_the_proxy_on_two_nodes(cluster: Cluster) -> None:
    expected = cluster.expected
    with httpx.Client() as client:
        seen: dict[str, int] = {}
        for i in range(40):  # the proxy spreads requests: both replicas answer, each one rightly
            r = _classify(client, cluster.url, expected, i % 2)
            assert r.status_code == 200, r.text
            assert expected.problem(r.json(), i % 2) is None
            seen[r.headers[REPLICA_HEADER]] = seen.get(r.headers[REPLICA_HEADER], 0) + 1
            if len(seen) == 2 and i >= 3:
                break
        assert len(seen) == 2, f"one replica answered everything: {seen}"
        # The same app: its errors, health and metrics, and management closed without the token.
        bad = client.post(f"{cluster.url}/classify", files={"image": ("x.jpg", b"not an image")})
        assert bad.status_code == 415 and "error" in bad.json()
        assert client.get(f"{cluster.url}/readyz").json()["status"] == "ready"
        assert "memvit_requests_total" in client.get(f"{cluster.url}/metrics").text
        assert client.post(f"{cluster.url}/adapters", files={"bundle": ("b", b"x")}).status_code == 401
    # One replica on each node, as the memvit_slot resource forces.
    replicas = cluster.describe()
    assert set(replicas) == set(seen)
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert sorted(nodes[r["node_id"]] for r in replicas.values()) == [cluster.head.ip, cluster.worker.ip]
    FIGURES["replicas"] = {r: nodes[info["node_id"]] for r, info in replicas.items()}


def test_a_registration_reaches_every_replica_within_the_poll_bound(cluster: Cluster) -> None:
    bound = 2 * POLL_SECONDS + 1.0  # two polls (README), plus a request's round trip on a busy machine
    with httpx.Client() as client:
        cluster.register(client, LATE_ADAPTER)
        registered_at = time.monotonic()
        serving: dict[str, float] = {}
        deadline = registered_at + 30
        i = 0
        while len(serving) < 2 and time.monotonic() < deadline:
            r = _classify(client, cluster.url, cluster.expected, i % 2)
            assert r.status_code == 200 and cluster.expected.problem(r.json(), i % 2) is None, r.text
            if LATE_ADAPTER in r.json()["tasks"]:
                serving.setdefault(r.headers[REPLICA_HEADER], time.monotonic() - registered_at)
            i += 1
    assert len(serving) == 2, f"not every replica serves {LATE_ADAPTER} after 30s: {serving}"
    assert max(serving.values()) <= bound, f"slower than {bound}s: {serving}"
    FIGURES["registration_seen_on_every_replica_s"] = round(max(serving.values()), 2)
