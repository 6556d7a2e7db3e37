"""The KServe example (docker/kserve): it renders with `kubectl kustomize`; the runtime's container is
valid against the Kubernetes API's V1Container schema; its probes are the Open Inference Protocol's
health routes on the port memvit serves; its settings are real Settings fields; the InferenceService
names this runtime, its model format and protocol; no field outside the ones KServe defines is used."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the kubernetes client is not installed (pip install -e '.[dev]')")

import kubernetes.client

from memvit.server.edge.routes import app_routes
from memvit.server.http.app import create_app
from memvit.server.settings import Settings

from .k8s_render import _kubectl
from .k8s_schema import _check_model

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "docker" / "kserve"
# The fields of KServe's resources this example may use (serving.kserve.io v1alpha1/v1beta1).
RUNTIME_SPEC = {"supportedModelFormats", "protocolVersions", "multiModel", "containers", "volumes"}
FORMAT_FIELDS = {"name", "version", "autoSelect"}
PREDICTOR = {"minReplicas", "maxReplicas", "model"}
MODEL = {"runtime", "modelFormat", "protocolVersion", "storageUri", "env", "resources"}


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(KSERVE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return {o["kind"]: o for o in yaml.safe_load_all(result.stdout)}


def _errors(value: object, model: type, path: str) -> list[str]:
    errors: list[str] = []
    _check_model(value, model, path, errors)
    return errors


def _env(container_or_model: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container_or_model.get("env", [])}


def test_the_runtime_serves_the_protocol_on_its_port(objects) -> None:
    runtime = objects["ServingRuntime"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    assert set(spec) <= RUNTIME_SPEC and spec["protocolVersions"] == ["v2"]
    assert all(set(f) <= FORMAT_FIELDS for f in spec["supportedModelFormats"])
    (container,) = spec["containers"]
    assert _errors(container, kubernetes.client.V1Container, "container") == []
    for volume in spec.get("volumes", []):
        assert _errors(volume, kubernetes.client.V1Volume, "volume") == []
    env = _env(container)
    assert all(name.removeprefix("MEMVIT_").lower() in Settings.model_fields for name in env)
    port = int(env["MEMVIT_PORT"])
    assert [p["containerPort"] for p in container["ports"]] == [port] == [8080]  # KServe's default
    assert env["MEMVIT_HOST"] == "0.0.0.0"
    served = {path for method, path in app_routes(create_app(Settings(port=port))) if method == "GET"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == port and get["path"] in served and get["path"].startswith("/v2/health/")
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_the_inference_service_uses_the_runtime(objects) -> None:
    service = objects["InferenceService"]
    runtime = objects["ServingRuntime"]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    predictor = service["spec"]["predictor"]
    assert set(predictor) <= PREDICTOR
    model = predictor["model"]
    assert set(model) <= MODEL
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    for entry in model["env"]:
        assert _errors(entry, kubernetes.client.V1EnvVar, "env") == []
        assert entry["name"].removeprefix("MEMVIT_").lower() in Settings.model_fields
    assert _errors(model["resources"], kubernetes.client.V1ResourceRequirements, "resources") == []
    # The weights are where KServe's storage initializer puts storageUri.
    assert _env(model)["MEMVIT_WEIGHTS"].startswith("/mnt/models/")
