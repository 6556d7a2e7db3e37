"""The Kubernetes manifests (docker/k8s): every overlay renders with `kubectl kustomize`, every object
it renders is valid against the Kubernetes API schema (k8s_schema.py: the official client's models),
and what has to agree with the image and the service does: probes on /readyz and /healthz at the
container's port, which is the Service's target and MEMVIT_PORT; the HPA on the Deployment; the PDB
and the Service on its pods; the admin token from the Secret; settings that are real Settings fields;
the image's user; the GPU overlay on a GPU.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the kubernetes client is not installed (pip install -e '.[dev]')")

from memvit.server.routers import health
from memvit.server.settings import Settings

from .k8s_schema import validate

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
TARGETS = ("base", "overlays/cpu", "overlays/gpu")
KINDS = {"ServiceAccount", "ConfigMap", "Secret", "Service", "Deployment", "HorizontalPodAutoscaler",
         "PodDisruptionBudget"}  # fmt: skip
SECRET_KEYS = {"MEMVIT_ADMIN_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")


# --- rendering -----------------------------------------------------------------------------------


def _kubectl() -> str:
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubernetes-client); CI installs it")
    return kubectl


def _example_secrets() -> dict[str, str]:
    """secrets.env.example's keys, commented-out ones included, with their values as written."""
    text = (K8S / "base" / "secrets.env.example").read_text()
    return dict(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=(.*)$", text, re.M))


def _tree(tmp: Path, secrets: dict[str, str] | None) -> Path:
    """A copy of docker/k8s with ``secrets`` as base/secrets.env (none: no such file), so that a
    developer's own secrets.env never reaches the test, nor the test's the checkout."""
    tree = tmp / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    if secrets is not None:
        (tree / "base" / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in secrets.items()))
    return tree


def _kustomize(tree: Path, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_kubectl(), "kustomize", str(tree / target)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every target rendered, with every key of the Secret's template filled in."""
    secrets = {key: f"test-{key.lower()}" for key in _example_secrets()}
    tree = _tree(tmp_path_factory.mktemp("k8s"), secrets)
    out = {}
    for target in TARGETS:
        result = _kustomize(tree, target)
        assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
        out[target] = [obj for obj in yaml.safe_load_all(result.stdout) if obj is not None]
    return out


def _one(objects: list[dict], kind: str) -> dict:
    matches = [obj for obj in objects if obj["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, got {len(matches)}"
    return matches[0]


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _container(objects: list[dict]) -> dict:
    containers = _pod(_one(objects, "Deployment"))["containers"]
    assert [c["name"] for c in containers] == ["memvit"]
    return containers[0]


def _port(container: dict, port: int | str) -> int:
    """A port by number or by the container's name for it, as the kubelet and the Service resolve it."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    assert numbers, f"no container port named {port!r}"
    return numbers[0]


def _settings(objects: list[dict]) -> dict[str, str]:
    return _one(objects, "ConfigMap")["data"]


def _dockerfile_final_stage() -> str:
    return (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# --- the schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_is_valid_against_the_api_schema(rendered, target: str) -> None:
    objects = rendered[target]
    assert {obj["kind"] for obj in objects} == KINDS
    errors = [error for obj in objects for error in validate(obj)]
    assert not errors, "\n".join(errors)


def _source_deployment() -> dict:
    """The base's Deployment as written (already a complete object), so these run without kubectl."""
    return yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())


def _first(d: dict) -> dict:
    return _pod(d)["containers"][0]


BREAKAGES: dict[str, tuple[Callable[[dict], object], str]] = {
    "misspelt field": (
        lambda d: _first(d).__setitem__("readinesProbe", _first(d).pop("readinessProbe")),
        "unknown field 'readinesProbe' in V1Container",
    ),
    "python name for a field": (
        lambda d: _first(d).__setitem__("env_from", _first(d).pop("envFrom")),
        "unknown field 'env_from'",
    ),
    "string for an int": (
        lambda d: _first(d)["ports"][0].__setitem__("containerPort", "8000"),
        "containerPort: expected int, got str",
    ),
    "string for a bool": (
        lambda d: _first(d)["securityContext"].__setitem__("readOnlyRootFilesystem", "true"),
        "readOnlyRootFilesystem: expected bool, got str",
    ),
    "number for a quantity": (
        lambda d: _first(d)["resources"]["limits"].__setitem__("cpu", 4),
        "limits['cpu']: expected str, got int",
    ),
    "float for an int-or-string": (
        lambda d: _first(d)["livenessProbe"]["httpGet"].__setitem__("port", 8000.0),
        "port: expected an int or a string, got float",
    ),
    "map for a list": (
        lambda d: _first(d).__setitem__("ports", {"http": 8000}),
        "ports: expected a list, got dict",
    ),
    "missing required field": (
        lambda d: d["spec"].pop("selector"),
        "spec: missing required field 'selector'",
    ),
    "missing container name": (lambda d: _first(d).pop("name"), "missing required field 'name'"),
    "removed apiVersion": (
        lambda d: d.__setitem__("apiVersion", "extensions/v1beta1"),
        "apiVersion 'extensions/v1beta1' is not served",
    ),
    "kind in the wrong group": (
        lambda d: d.__setitem__("kind", "HorizontalPodAutoscaler"),
        "apiVersion 'apps/v1' has no kind 'HorizontalPodAutoscaler'",
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES, ids=list(BREAKAGES))
def test_the_validator_rejects_what_the_api_would(breakage: str) -> None:
    deployment = _source_deployment()
    assert validate(deployment) == [], "the control: the Deployment as written is valid"
    broken = copy.deepcopy(deployment)
    mutate, expected = BREAKAGES[breakage]
    mutate(broken)
    errors = validate(broken)
    assert any(expected in error for error in errors), errors


def test_the_validator_takes_both_forms_of_int_or_string_and_checks_secret_data() -> None:
    deployment = _source_deployment()
    _first(deployment)["livenessProbe"]["httpGet"]["port"] = 8000
    assert validate(deployment) == []
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "data": {"A": "dGVzdA=="}}
    assert validate(secret) == []
    secret["data"]["A"] = "not base64!"
    assert validate(secret) == ["Secret.data['A']: expected base64 text, got str 'not base64!'"]


# --- what the manifests must agree on -----------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_probes_service_and_metrics_reach_the_servers_port(rendered, target: str) -> None:
    objects = rendered[target]
    container, settings = _container(objects), _settings(objects)
    routes = {route.path for route in health.router.routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    # Liveness and start-up never wait on loading: a replica reading thousands of adapters lives.
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"

    port = int(settings["MEMVIT_PORT"])
    assert settings["MEMVIT_HOST"] == "0.0.0.0", "probes and the Service reach the pod from outside"
    assert re.search(rf"^EXPOSE {port}$", _dockerfile_final_stage(), re.M), "the image's port"
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _port(container, container[probe]["httpGet"]["port"]) == port, probe
    service = _one(objects, "Service")
    assert [_port(container, p["targetPort"]) for p in service["spec"]["ports"]] == [port]

    annotations = _one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in routes


@pytest.mark.parametrize("target", TARGETS)
def test_a_replica_has_time_to_start_and_to_drain(rendered, target: str) -> None:
    objects = rendered[target]
    container, pod = _container(objects), _pod(_one(objects, "Deployment"))
    startup = container["startupProbe"]
    start_period = re.search(r"--start-period=(\d+)s", _dockerfile_final_stage())
    assert startup["periodSeconds"] * startup["failureThreshold"] >= int(start_period.group(1)), (
        "at least the start-up time the image's own HEALTHCHECK allows"
    )
    # SIGTERM comes after preStop; uvicorn then drains requests in flight for up to its own timeout.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = re.search(r"timeout_graceful_shutdown=(\d+)", (ROOT / "server" / "cli" / "serve.py").read_text())
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + int(drain.group(1))


@pytest.mark.parametrize("target", TARGETS)
def test_the_hpa_scales_the_deployment_on_cpu(rendered, target: str) -> None:
    objects = rendered[target]
    deployment, hpa = _one(objects, "Deployment"), _one(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"]
    )  # fmt: skip
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"] == ["cpu"]
    assert "cpu" in _container(objects)["resources"]["requests"], "utilisation is measured against requests"
    assert "replicas" not in deployment["spec"], "the HPA owns the count; an apply must not reset it"
    pdb = _one(objects, "PodDisruptionBudget")
    assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"] >= 1, (
        "the PDB keeps a replica and still lets a drain evict one"
    )


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_pick_the_deployments_pods(rendered, target: str) -> None:
    objects = rendered[target]
    deployment = _one(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deployment["spec"]["selector"],
        "PodDisruptionBudget": _one(objects, "PodDisruptionBudget")["spec"]["selector"],
        "Service": {"matchLabels": _one(objects, "Service")["spec"]["selector"]},
    }
    for i, spread in enumerate(_pod(deployment)["topologySpreadConstraints"]):
        selectors[f"topology spread {i}"] = spread["labelSelector"]
    for owner, selector in selectors.items():
        assert set(selector) == {"matchLabels"} and selector["matchLabels"], owner
        assert selector["matchLabels"].items() <= labels.items(), f"{owner} does not select the pods"


@pytest.mark.parametrize("target", TARGETS)
def test_secrets_come_from_the_generated_secret(rendered, target: str) -> None:
    objects = rendered[target]
    container, secret, config = _container(objects), _one(objects, "Secret"), _one(objects, "ConfigMap")
    refs = {name: e["valueFrom"]["secretKeyRef"] for name, e in _env(container).items()
            if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    token = refs["MEMVIT_ADMIN_TOKEN"]
    assert not token.get("optional", False), "no token, no pod: never start with management open"
    for name, ref in refs.items():
        # The generated name carries a content hash: equal names mean kustomize rewrote the reference.
        assert ref["name"] == secret["metadata"]["name"], name
        assert ref["key"] in secret["data"] or ref.get("optional"), f"{name}: no key {ref['key']}"
    # The template documents exactly what the container reads from the Secret.
    assert {ref["key"] for ref in refs.values()} == set(_example_secrets())
    sources = [s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s]
    assert sources == [config["metadata"]["name"]]
    assert not SECRET_KEYS & set(config["data"]), "secrets belong in the Secret, not the ConfigMap"


@pytest.mark.parametrize("target", TARGETS)
def test_settings_are_real_fields_of_the_service(rendered, target: str) -> None:
    objects = rendered[target]
    container, settings = _container(objects), _settings(objects)
    names = [k for k in [*settings, *_env(container)] if k.startswith("MEMVIT_")]
    fields = {name.removeprefix("MEMVIT_").lower() for name in names}
    unknown = fields - set(Settings.model_fields)
    assert not unknown, f"not settings of server/settings.py: {sorted(unknown)}"
    # The values too: Settings parses them as it would from the environment (a bad value raises).
    values = {k.removeprefix("MEMVIT_").lower(): v for k, v in settings.items() if k.startswith("MEMVIT_")}
    parsed = Settings(_env_file=None, **values)
    assert parsed.adapter_store.startswith(OBJECT_STORE_SCHEMES), "replicas must share one store"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert parsed.weights.parent.as_posix() in mounts and mounts[parsed.weights.parent.as_posix()]["readOnly"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_pod_runs_as_the_images_user_on_a_read_only_root(rendered, target: str) -> None:
    objects = rendered[target]
    pod = _pod(_one(objects, "Deployment"))
    container = _container(objects)
    uid = re.search(r"^USER (\d+):(\d+)$", _dockerfile_final_stage(), re.M)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        int(uid.group(1)), int(uid.group(2))
    )  # fmt: skip
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # Uploads spool to /tmp: the one writable place, an emptyDir.
    volumes = {v["name"]: v for v in pod["volumes"]}
    tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == _one(objects, "ServiceAccount")["metadata"]["name"]


def _image_tag(objects: list[dict]) -> str:
    image = _container(objects)["image"]
    name, _, tag = image.rpartition(":")
    assert name and "/" in name and tag and tag != "latest", f"a registry and a version tag: {image}"
    return tag


def test_the_gpu_overlay_runs_on_a_gpu_and_the_cpu_overlay_does_not(rendered) -> None:
    gpu, cpu = rendered["overlays/gpu"], rendered["overlays/cpu"]
    resources = _container(gpu)["resources"]
    assert int(resources["limits"].get("nvidia.com/gpu", "0")) >= 1, "one GPU per replica"
    assert _settings(gpu)["MEMVIT_DEVICE"] == "cuda"
    pod = _pod(_one(gpu, "Deployment"))
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), "GPU nodes are tainted"
    assert any("nvidia.com/gpu" in key for key in pod["nodeSelector"]), "only GPU nodes"
    assert _image_tag(gpu) != _image_tag(cpu), "a CUDA build on GPUs, the CPU build elsewhere"

    assert _settings(cpu)["MEMVIT_DEVICE"] == "cpu"
    assert "nvidia.com/gpu" not in str(_container(cpu)["resources"])
    assert "tolerations" not in _pod(_one(cpu, "Deployment"))


def test_nothing_renders_until_the_secret_is_filled_in(tmp_path: Path) -> None:
    """Safe by default, like the compose file: with no secrets.env, kustomize stops and names it."""
    result = _kustomize(_tree(tmp_path, secrets=None), "overlays/cpu")
    assert result.returncode != 0 and "secrets.env" in result.stderr, result.stderr


def test_the_secret_template_holds_no_secret() -> None:
    assert _example_secrets(), "the template names its keys"
    assert {k: v for k, v in _example_secrets().items() if v} == {}, "placeholders are left empty"
    assert "secrets.env" in (K8S / "base" / ".gitignore").read_text().split()
