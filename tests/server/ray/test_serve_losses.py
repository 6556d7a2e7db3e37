"""Losses on the Ray cluster under load (the cluster: tests/server/ray/conftest.py, test_serve.py):
a replica killed, a node lost, nothing registered lost; each lost request answered 503 + Retry-After."""

from __future__ import annotations

import hashlib
import time
from itertools import count

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the ray extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")

from memvit.server.ray.affinity import KEY_HEADER  # noqa: E402
from memvit.server.ray.router import rendezvous_order  # noqa: E402
from memvit.server.ray.serve import REPLICA_HEADER  # noqa: E402
from memvit.server.registry import Catalog  # noqa: E402
from memvit.server.store import open_store  # noqa: E402
from tests.server.ray.cluster import FIGURES, LOSS_WINDOW, SLOT, Cluster, _nothing_to_migrate  # noqa: E402
from tests.server.ray.load import Load, _check_losses, _hold, _release, _replacement_serving  # noqa: E402
from tests.server.ray_cluster import RayNode  # noqa: E402


def test_killing_a_replica_under_load(cluster: Cluster) -> None:
    before = cluster.both_replicas()
    victim = before[min(before)]
    held, on_victim = _hold(cluster, victim["replica"])
    with Load(cluster) as load:
        load.wait_for(lambda o: o.replica == victim["replica"], 30, "the victim answering under load")
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        held_503_s = _release(held, on_victim, killed_at)
        # Serve starts a replacement (on the victim's node: the only free memvit_slot); the adapter
        # registered before comes from the bucket with it.
        replacement = _replacement_serving(cluster, load, before)
    figures = _check_losses(load.outcomes, killed_at)
    assert all(o.replica != victim["replica"] for o in load.outcomes if o.started > killed_at + LOSS_WINDOW)
    FIGURES["replica_kill"] = {
        "recovered_s": round(replacement.ended - killed_at, 1),
        "held_503s": on_victim,
        "held_503_after_s": round(held_503_s, 2),
        **figures,
    }


def test_losing_a_node_under_load(cluster: Cluster) -> None:
    before = cluster.both_replicas()
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    lost = next(r for r in before.values() if nodes[r["node_id"]] == cluster.worker.ip)
    kept = next(r for r in before.values() if nodes[r["node_id"]] == cluster.head.ip)
    held, on_lost = _hold(cluster, lost["replica"])
    with Load(cluster) as load:
        load.wait_for(lambda o: o.replica == lost["replica"], 30, "the second node's replica answering")
        lost_at = time.monotonic()
        cluster.worker.kill()  # SIGKILL: raylet, agents, the replica, all at once
        held_503_s = _release(held, on_lost, lost_at)
        # A machine comes back (as Kubernetes restarts a pod): Serve places the replacement there.
        node = RayNode("127.0.0.4", cluster.temp_dir, head=cluster.head, resources=SLOT, env=cluster.env)
        cluster.nodes.append(node.start())
        node_back_s = time.monotonic() - lost_at
        replacement = _replacement_serving(cluster, load, before)
    figures = _check_losses(load.outcomes, lost_at)
    # Until the replacement answered, the head's replica served alone (and served).
    first_new = min(o.started for o in load.outcomes if o.replica not in (None, *before))
    gap = [o for o in load.outcomes if lost_at + LOSS_WINDOW < o.started < first_new and o.status == 200]
    assert gap and {o.replica for o in gap} == {kept["replica"]}
    after = cluster.both_replicas()
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert sorted(nodes[r["node_id"]] for r in after.values()) == [cluster.head.ip, node.ip]
    FIGURES["node_loss"] = {
        "node_back_s": round(node_back_s, 1),
        "recovered_s": round(replacement.ended - lost_at, 1),
        "held_503s": on_lost,
        "held_503_after_s": round(held_503_s, 2),
        **figures,
    }


def _key_homed_on(replica: str, replicas: list[str]) -> str:
    """A routing key whose home, among ``replicas``, is ``replica`` (rendezvous hashing)."""
    return next(k for i in count() if rendezvous_order(k := f"probe-{i}", replicas)[0] == replica)


def test_nothing_registered_is_lost(cluster: Cluster) -> None:
    replicas = list(cluster.both_replicas())
    stored = Catalog(open_store(cluster.store))  # the bucket's registry, read afresh
    stored.open(_nothing_to_migrate, max_bytes=1 << 26)
    assert set(stored.state.adapters) == set(cluster.registered)
    assert set(stored.invalid) == {f"{name}.safetensors" for name in cluster.junk}
    for name, sha in cluster.registered.items():
        assert hashlib.sha256(stored.journal.get_bundle(stored.get(name))).hexdigest() == sha
    # Every replica's own list: each asked by a key it is the home of (server/ray/router.py). Not by
    # unkeyed requests: Serve's proxy keeps each replica's queue length in a cache (10 s), and after a
    # load it may hold a stale count above zero for one replica; the shorter queue always wins, so
    # every one of a quick series of unkeyed requests can go to the other replica.
    seen: dict[str, dict] = {}
    with httpx.Client() as client:
        for _ in range(10):
            for replica in set(replicas) - set(seen):
                headers = {KEY_HEADER.decode(): _key_homed_on(replica, replicas)}
                r = client.get(f"{cluster.url}/adapters", headers=headers, timeout=20)
                assert r.status_code == 200, r.text
                seen[r.headers[REPLICA_HEADER]] = {a["name"]: a["sha256"] for a in r.json()["adapters"]}
            if len(seen) == 2:
                break
    assert set(seen) == set(replicas), f"not every replica answered: {list(seen)} of {replicas}"
    assert all(adapters == cluster.registered for adapters in seen.values()), seen
