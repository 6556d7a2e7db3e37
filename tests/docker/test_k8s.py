"""The Kubernetes manifests (docker/k8s): every overlay renders with `kubectl kustomize`, every object
it renders is valid against the Kubernetes API schema (k8s_schema.py: the official client's models),
and what has to agree with the image and the service does: probes on /readyz and /healthz at the
container's port, which is the Service's target and MEMVIT_PORT; the HPA on the Deployment; the PDB
and the Service on its pods; the admin token from the Secret; settings that are real Settings fields;
the image's user; the GPU overlay on a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memvit.server.routers import health
from memvit.server.settings import Settings

from .k8s_render import (
    K8S,
    OBJECT_STORE_SCHEMES,
    ROOT,
    SECRET_KEYS,
    TARGETS,
    _container,
    _dockerfile_final_stage,
    _env,
    _example_secrets,
    _kustomize,
    _one,
    _pod,
    _port,
    _settings,
    _tree,
)

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
