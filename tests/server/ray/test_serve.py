"""memvit on a real two-node Ray cluster on this machine (server/ray/serve.py, docker/ray/).

One cluster for the module, shared by the tests in order: a head and a second node, each ``ray start
--block`` in its own session on a loopback address, one ``memvit_slot`` resource each so the two
replicas land one per node; the shipped Serve config (docker/ray/serve-config.yaml, adjusted for
ports, resources and the test bucket) deployed with ``serve run``; a bucket on the S3 test server as
the registry the replicas share. Every answer the tests get is checked against logits computed here.

Losses happen under load (CLIENTS threads classifying through the proxy) and with requests the lost
replica is known to hold (bodies stopped halfway, placed by each replica's count of requests in
flight), so the 503 + Retry-After for a request lost mid-flight is checked every time, not by luck.
Every test needs only what the fixture sets up (the cluster, with ADAPTER registered), not what an
earlier test did: a test run alone (``-k``, ``--lf``) or on a pytest-xdist worker that did not get
the earlier tests (each worker builds its own cluster) checks the same things. Figures (start-up,
recovery, 503s) are logged at the end of the module.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import logging
import select
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from PIL import Image

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the ray extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve", reason="the Ray Serve tests need the ray extra (ray[serve])")

from memvit.adapters import bundle_for  # noqa: E402
from memvit.adapters.preprocess import eval_transform, to_rgb  # noqa: E402
from memvit.memory_core import MemoryViT  # noqa: E402
from memvit.server.ray.affinity import KEY_HEADER  # noqa: E402
from memvit.server.ray.proxy import CALLBACK, CALLBACK_ENV  # noqa: E402
from memvit.server.ray.router import rendezvous_order  # noqa: E402
from memvit.server.ray.serve import REPLICA_HEADER  # noqa: E402
from memvit.server.registry import Catalog  # noqa: E402
from memvit.server.store import open_store  # noqa: E402
from tests.factories import random_adapter  # noqa: E402
from tests.server.conftest import TOKEN  # noqa: E402
from tests.server.launcher import REPO, free_port  # noqa: E402
from tests.server.ray_cluster import RayNode, node_temp_dir, stop_all  # noqa: E402

log = logging.getLogger(__name__)
CONFIG = REPO / "docker" / "ray" / "serve-config.yaml"
APP = DEPLOYMENT = "memvit"
ADAPTER = "flowers"  # registered by the fixture: every replica, replacements included, must serve it
LATE_ADAPTER = "birds"  # registered by the registration test, while the replicas run
POLL_SECONDS = 0.5
# Objects in the bucket that are not bundles, as a store written before the journal may hold: the
# first replicas to start read each once, migrating the store (they are listed as invalid, never
# served), so their loading takes a few seconds, long enough that a replica Serve routed to before it
# was loaded would be caught answering "still loading".
JUNK = 100
CLIENTS = 6  # concurrent clients of the load: at most this many requests are in flight on a dying replica
LOSS_WINDOW = 5.0  # a 503 for a lost replica must come within this many seconds of the loss
SLOT = {"memvit_slot": 1}  # every node offers one, every replica takes one: one replica per node
# The routing test (last): TENANTS adapters over two replicas that hold RESIDENT each: one replica
# could not hold them all; each replica's slice fits beside the two adapters above (but for a split
# of 8:2 or worse, 11% of runs, where that replica's hits are not checked).
TENANTS = 10
RESIDENT = 9
FIGURES: dict[str, object] = {}


# -- the expected answers --------------------------------------------------------------------------
@dataclass
class Expected:
    images: list[bytes]
    base: list[torch.Tensor]
    adapters: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> logits per image

    def problem(self, body: dict, index: int) -> str | None:
        """What is wrong with an answer for image ``index``, or None (logits to 1e-4, as batches vary)."""
        tasks = body["results"][0]["tasks"]
        got = {name: torch.tensor(task["logits"]) for name, task in tasks.items()}
        if set(got) != set(body["tasks"]):
            return f"tasks {sorted(got)} answered, {sorted(body['tasks'])} computed"
        if not torch.allclose(got["base"], self.base[index], atol=1e-4):
            return f"base logits of image {index} differ"
        for name in set(got) - {"base"}:
            if name not in self.adapters:
                return f"unexpected task {name}"
            if not torch.allclose(got[name], self.adapters[name][index], atol=1e-4):
                return f"{name} logits of image {index} differ"
        return None


def _jpeg(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), colour).save(buf, format="JPEG")
    return buf.getvalue()


# -- the cluster -----------------------------------------------------------------------------------
@dataclass
class Cluster:
    url: str
    head: RayNode
    worker: RayNode
    store: str
    temp_dir: Path
    expected: Expected
    bundles: dict[str, bytes]  # name -> bundle, for ADAPTER and LATE_ADAPTER
    registered: dict[str, str]  # name -> sha256: what the module's tests have registered so far
    nodes: list[RayNode]
    env: dict[str, str]
    junk: set[str]

    def register(self, client: httpx.Client, name: str) -> None:
        """Register bundle ``name`` through the proxy, and remember it as registered."""
        files = {"bundle": ("b", self.bundles[name])}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        r = client.post(f"{self.url}/adapters", files=files, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
        self.registered[name] = hashlib.sha256(self.bundles[name]).hexdigest()

    def describe(self, want: int = 2, tries: int = 40) -> dict[str, dict]:
        """Each running replica's own account, through a Serve handle.

        Each call carries its own routing key, so the router (server/ray/router.py) sends it to that
        key's home, a replica drawn by the hash: ``tries`` calls miss one of two replicas with
        odds of 2**-tries. Unkeyed, Serve would send every call to the replica with the shorter
        queue: never to one holding a test's requests (``_hold``) while the other holds none."""
        handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
        found: dict[str, dict] = {}
        try:
            for i in range(tries):
                keyed = handle.options(multiplexed_model_id=f"describe-{i}")
                info = keyed.describe.remote().result(timeout_s=30)
                found[info["replica"]] = info
                if len(found) >= want:
                    break
        finally:
            # A handle starts a router thread in this process that outlives ray.shutdown(): left
            # running, its metrics push calls ray.wait, whose auto-init starts a whole new local Ray
            # in the test process, which then eats the CPU of every test after this module.
            handle.shutdown()
        return found

    def both_replicas(self) -> dict[str, dict]:
        """The two replicas, once Serve runs two (after a failed test left one, say) and a handle
        reaches both (Serve may count a replica running before this process routes to it)."""

        def two() -> dict[str, dict] | None:
            states = serve.status().applications[APP].deployments[DEPLOYMENT].replica_states
            if states.get("RUNNING", 0) != 2:
                return None
            found = self.describe()
            return found if len(found) == 2 else None

        found = _wait(two, 120, "two replicas running", 0.5)
        assert len(found) == 2, found
        return found


def _test_config(path: Path, port: int, store: str, weights: Path, region: str) -> Path:
    """The shipped config, with what a test on one machine must change; everything else as shipped."""
    config = yaml.safe_load(CONFIG.read_text())
    config["proxy_location"] = "HeadOnly"  # the tests' clients talk to the head's proxy
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = config["applications"]
    app["runtime_env"]["env_vars"].update(
        MEMVIT_ADAPTER_STORE=store,
        MEMVIT_WEIGHTS=str(weights),
        MEMVIT_STORE_POLL_SECONDS=str(POLL_SECONDS),
        MEMVIT_RESIDENT_ADAPTERS=str(RESIDENT),
        MEMVIT_MAX_TASKS_PER_REQUEST=str(RESIDENT),
        AWS_REGION=region,
    )
    (deployment,) = app["deployments"]
    deployment["autoscaling_config"].update(min_replicas=2, initial_replicas=2, max_replicas=2)
    # One replica per node: each node offers one memvit_slot and each replica takes one.
    deployment["ray_actor_options"] = {"num_cpus": 1, "resources": SLOT}
    path.write_text(yaml.safe_dump(config))
    return path


def _fill_with_junk(env: dict[str, str], bucket: str, count: int) -> set[str]:
    from tests.server.s3 import s3_client

    client = s3_client(env)
    names = {f"junk-{i:04d}" for i in range(count)}
    for name in names:
        client.put_object(Bucket=bucket, Key=f"adapters/{name}.safetensors", Body=b"not a bundle")
    return names


def _wait(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(interval)


@pytest.fixture(scope="module")
def ray_auth_mode() -> Iterator[None]:
    """Ray's token authentication, named rather than guessed, for the nodes (which inherit this
    environment) and this driver: Ray 2.60 turns it on by itself on a head that finds
    ~/.ray/auth_token (any local ray.init() writes one) but not on a node joining it, which is then
    refused. Off, because this driver reads the mode once, when ray is imported; the cluster lives
    for one test module on loopback addresses (its GCS port listens on every interface, as Ray's does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        yield


@pytest.fixture(scope="module")
def cluster(s3_env, tiny_weights, ray_auth_mode, tmp_path_factory) -> Iterator[Cluster]:
    from click.testing import CliRunner
    from ray.serve.scripts import cli as serve_cli

    from tests.server.s3 import new_bucket

    started = time.monotonic()
    temp_dir = node_temp_dir()
    bucket = new_bucket(s3_env)
    store = f"s3://{bucket}/adapters"
    junk = _fill_with_junk(s3_env, bucket, JUNK)
    # What every node's `ray start` gets (docker/ray/README.md): the proxy callback and the secrets
    # (admin token, AWS_* from s3_env, set in this process). Locality routing off: the tests send
    # everything through the head's proxy, which would otherwise keep it on the head's replica.
    env = {
        CALLBACK_ENV: CALLBACK,
        "MEMVIT_ADMIN_TOKEN": TOKEN,
        "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
    }
    nodes: list[RayNode] = []
    try:
        head = RayNode("127.0.0.2", temp_dir, resources=SLOT, env=env).start()
        nodes.append(head)
        worker = RayNode("127.0.0.3", temp_dir, head=head, resources=SLOT, env=env).start()
        nodes.append(worker)
        FIGURES["nodes_started_s"] = round(time.monotonic() - started, 1)
        ray.init(address=head.address, log_to_driver=False, logging_level=logging.WARNING)

        port = free_port()
        config = _test_config(temp_dir / "serve-config.yaml", port, store, tiny_weights, s3_env["AWS_REGION"])
        result = CliRunner().invoke(serve_cli, ["run", "--non-blocking", str(config)])
        assert result.exit_code == 0, result.output
        _wait(
            lambda: getattr(serve.status().applications.get(APP), "status", None) == "RUNNING",
            240,
            "the application running",
            0.5,
        )
        FIGURES["deployed_s"] = round(time.monotonic() - started, 1)

        engine = MemoryViT.from_timm(weights=str(tiny_weights))
        images = [_jpeg((200, 30, 30)), _jpeg((20, 40, 220))]
        transform = eval_transform(engine)
        x = torch.stack([transform(to_rgb(Image.open(io.BytesIO(data)))) for data in images])
        adapters = [random_adapter(name, engine, m=2, classes=5) for name in (ADAPTER, LATE_ADAPTER)]
        with torch.inference_mode():
            base = engine(x).base
            logits = engine(x, engine.prepare_set(adapters)).adapters
        cluster = Cluster(
            url=f"http://127.0.0.1:{port}",
            head=head,
            worker=worker,
            store=store,
            temp_dir=temp_dir,
            expected=Expected(images, list(base), {name: list(t) for name, t in logits.items()}),
            bundles={a.name: bundle_for(a, engine).to_bytes() for a in adapters},
            registered={},
            nodes=nodes,
            env=env,
            junk=junk,
        )
        # Here, not in a test: the losses check that a replacement replica serves what the registry
        # holds, whichever tests ran before them in this process (none, under -k or on an xdist worker).
        with httpx.Client() as client:
            cluster.register(client, ADAPTER)
        yield cluster
    finally:
        logs = temp_dir / "session_latest" / "logs"
        if logs.is_dir():  # kept for a look after a failure (pytest keeps its last few tmp dirs)
            shutil.copytree(logs, tmp_path_factory.mktemp("ray-logs"), dirs_exist_ok=True, symlinks=True)
        if ray.is_initialized():
            ray.shutdown()
        stop_all(nodes, temp_dir)
        FIGURES["module_s"] = round(time.monotonic() - started, 1)
        log.warning("ray serve figures: %s", FIGURES)


def _classify(client: httpx.Client, url: str, expected: Expected, index: int) -> httpx.Response:
    files = {"image": (f"img{index}.jpg", expected.images[index], "image/jpeg")}
    return client.post(f"{url}/classify", files=files, params={"logits": True}, timeout=20)


# -- load while something is lost ------------------------------------------------------------------
@dataclass
class Outcome:
    started: float
    ended: float
    status: int | str  # an HTTP status, or the transport error's name
    retry_after: str | None = None
    replica: str | None = None
    adapters: tuple[str, ...] = ()
    error: str | None = None  # the error body's type
    problem: str | None = None


class Load:
    """CLIENTS threads classifying through the proxy, every answer checked; bounded in time and count."""

    def __init__(self, cluster: Cluster, max_seconds: float = 150.0, max_requests: int = 50_000) -> None:
        self.cluster = cluster
        self.deadline = time.monotonic() + max_seconds
        self.max_requests = max_requests
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _run(self, seed: int) -> None:
        expected = self.cluster.expected
        with httpx.Client() as client:
            i = seed
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                if len(self.outcomes) >= self.max_requests:
                    return
                index = i % len(expected.images)
                i += 1
                started = time.monotonic()
                try:
                    r = _classify(client, self.cluster.url, expected, index)
                except httpx.TransportError as exc:
                    self.outcomes.append(Outcome(started, time.monotonic(), type(exc).__name__))
                    continue
                outcome = Outcome(
                    started, time.monotonic(), r.status_code, r.headers.get("retry-after"),
                    r.headers.get(REPLICA_HEADER),
                )  # fmt: skip
                try:
                    body = r.json()
                    if r.status_code == 200:
                        outcome.adapters = tuple(body["tasks"])
                        outcome.problem = expected.problem(body, index)
                    elif "error" not in body:
                        outcome.problem = f"{r.status_code} without the service's error body"
                    else:
                        outcome.error = body["error"]["type"]
                except (ValueError, KeyError, IndexError) as exc:  # not the service's JSON at all
                    outcome.problem = f"{r.status_code} {r.text[:200]!r}: {exc!r}"
                self.outcomes.append(outcome)

    def wait_for(self, condition, timeout: float, what: str) -> Outcome:
        """The first outcome that meets ``condition`` (waiting for it while the load runs)."""

        def found() -> Outcome | None:
            return next((o for o in list(self.outcomes) if condition(o)), None)

        return _wait(found, timeout, what, 0.1)


def _check_losses(outcomes: list[Outcome], lost_at: float) -> dict[str, object]:
    """Every answer right, or a 503 with Retry-After within LOSS_WINDOW of the loss; nothing else."""
    other = [o for o in outcomes if o.status not in (200, 503)]
    assert not other, f"answers other than 200/503 (transport errors included): {other[:5]}"
    wrong = [o for o in outcomes if o.problem]
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[0]}"
    refused = [o for o in outcomes if o.status == 503]
    loading = [o for o in refused if o.error == "NotReadyError"]
    assert not loading, f"Serve routed to a replica still loading: {loading[:3]}"
    assert all(o.retry_after for o in refused), f"503 without Retry-After: {refused[:5]}"
    late = [o for o in refused if not lost_at <= o.ended <= lost_at + LOSS_WINDOW]
    assert not late, f"503s outside {LOSS_WINDOW}s of the loss: {[round(o.ended - lost_at, 2) for o in late]}"
    # Each client has one request in flight: only those on the lost replica can fail; others reroute.
    assert len(refused) <= CLIENTS, f"{len(refused)} 503s for {CLIENTS} clients"
    return {
        "requests": len(outcomes),
        "503s": len(refused),
        "503_at_s": [round(o.ended - lost_at, 2) for o in refused],
    }


def _serves_adapter(o: Outcome) -> bool:
    return o.status == 200 and ADAPTER in o.adapters and o.problem is None


def _replacement_serving(cluster: Cluster, load: Load, before: dict[str, dict]) -> Outcome:
    """The first answer from a replica started after ``before`` that serves ADAPTER. If none comes,
    the error says where each replica's registry stands against the bucket's: a replica behind the
    bucket did not pick the registry up; a bucket without ADAPTER was never given it."""
    try:
        return load.wait_for(
            lambda o: o.replica not in before and _serves_adapter(o), 120, "a replacement replica serving"
        )
    except TimeoutError as exc:
        stored = Catalog(open_store(cluster.store))
        stored.open(_nothing_to_migrate, max_bytes=1 << 26)
        replicas = {r: info["registry"] for r, info in cluster.describe().items()}
        raise TimeoutError(
            f"{exc}; the bucket: v{stored.version} {sorted(stored.state.adapters)}; the replicas: {replicas}"
        ) from None


# -- requests a replica is known to hold when it is lost -------------------------------------------
class HeldRequest:
    """A /classify whose body stops halfway: the replica Serve gave it waits for the rest, so it is
    in flight there for as long as we like (a raw socket: no client library waits for a response
    before the body is sent)."""

    def __init__(self, url: str, expected: Expected, index: int) -> None:
        self.expected, self.index = expected, index
        host, port = url.removeprefix("http://").split(":")
        boundary = f"memvit-held-{index}"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="held.jpg"\r\n'
                "Content-Type: image/jpeg\r\n\r\n"
            ).encode()
            + expected.images[index % len(expected.images)]
            + f"\r\n--{boundary}--\r\n".encode()
        )
        head = (
            f"POST /classify?logits=true HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        half = len(body) // 2
        self.rest = body[half:]
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(head + body[:half])

    def answered_early(self, timeout: float) -> bool:
        """Whether a response arrives before the body is complete (its replica was lost)."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def finish(self, early: bool) -> Outcome:
        """Sends the rest of the body unless answered early; the response, checked."""
        with self.sock:
            started = time.monotonic()
            if not early:
                self.sock.sendall(self.rest)
            response = http.client.HTTPResponse(self.sock)
            response.begin()
            data = response.read()
        outcome = Outcome(started, time.monotonic(), response.status, response.getheader("retry-after"))
        try:
            body = json.loads(data)
            if response.status == 200:
                outcome.adapters = tuple(body["tasks"])
                outcome.problem = self.expected.problem(body, self.index % len(self.expected.images))
            else:
                outcome.error = body["error"]["type"]
        except (ValueError, KeyError) as exc:
            outcome.problem = f"{response.status} {data[:200]!r}: {exc!r}"
        return outcome


def _hold(cluster: Cluster, target: str, at_most: int = 12) -> tuple[list[HeldRequest], int]:
    """Held requests until replica ``target`` holds at least one (Serve picks the replica; with no
    other traffic, each replica's count of requests in flight says where they went)."""
    held: list[HeldRequest] = []
    while len(held) < at_most:
        held.append(HeldRequest(cluster.url, cluster.expected, len(held)))
        counts = _wait(
            lambda: (lambda c: c if sum(c.values()) == len(held) else None)(
                {r: info["in_flight"] for r, info in cluster.describe().items()}
            ),
            20,
            "every held request reaching a replica",
        )
        if counts.get(target, 0) >= 1 and len(held) >= 2:
            return held, counts[target]
    raise AssertionError(f"{at_most} requests and none went to {target}")


def _release(held: list[HeldRequest], on_lost: int, lost_at: float) -> float:
    """After a loss: the requests the lost replica held are answered at once, 503 + Retry-After;
    the others are completed and answered rightly by the replica that holds them. Returns how long
    after the loss the last 503 came."""
    early: dict[int, float] = {}  # held request -> when its answer came
    deadline = lost_at + LOSS_WINDOW
    while len(early) < on_lost and time.monotonic() < deadline:
        for i, h in enumerate(held):
            if i not in early and h.answered_early(0.02):
                early[i] = time.monotonic()
    time.sleep(0.5)  # room for a wrong early answer from a replica that was not lost
    early |= {i: time.monotonic() for i, h in enumerate(held) if i not in early and h.answered_early(0)}
    outcomes = [h.finish(i in early) for i, h in enumerate(held)]
    lost = [outcomes[i] for i in sorted(early)]
    assert len(lost) == on_lost, f"{on_lost} requests were on the lost replica, {len(lost)} answered early"
    assert all(o.status == 503 and o.retry_after and o.error for o in lost), lost
    kept = [o for i, o in enumerate(outcomes) if i not in early]
    assert all(o.status == 200 and o.problem is None for o in kept), kept
    return max(early.values()) - lost_at


def _nothing_to_migrate(name: str, key: str, data: bytes):
    raise AssertionError("the replicas migrated the bucket when they started")


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
