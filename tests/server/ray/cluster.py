"""The Ray Serve tests' cluster and what they check its answers against (tests/server/ray/conftest.py
starts it, once for the package): the expected logits, the cluster's addresses and handles, the
test's Serve config (docker/ray/serve-config.yaml, adjusted), and the helpers every test uses."""

from __future__ import annotations

import hashlib
import io
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray
import torch
import yaml
from PIL import Image
from ray import serve

from memvit.adapters import bundle_for
from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT
from memvit.server.ray.proxy import CALLBACK, CALLBACK_ENV
from tests.factories import random_adapter
from tests.server.conftest import TOKEN
from tests.server.launcher import REPO, free_port
from tests.server.ray_cluster import RayNode, node_temp_dir, stop_all

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


def _classify(client: httpx.Client, url: str, expected: Expected, index: int) -> httpx.Response:
    files = {"image": (f"img{index}.jpg", expected.images[index], "image/jpeg")}
    return client.post(f"{url}/classify", files=files, params={"logits": True}, timeout=20)


def _nothing_to_migrate(name: str, key: str, data: bytes):
    raise AssertionError("the replicas migrated the bucket when they started")


def running_cluster(s3_env, tiny_weights, tmp_path_factory) -> Iterator[Cluster]:
    """The cluster, started (the package's ``cluster`` fixture), and stopped when the generator is closed."""
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
