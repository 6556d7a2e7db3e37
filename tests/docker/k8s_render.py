"""Rendering docker/k8s for the manifest tests: `kubectl kustomize` on a copy of the tree, and the
small readers the tests share (one object of a kind, the pod, its container, its port, its env)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
TARGETS = ("base", "overlays/cpu", "overlays/gpu")
KINDS = {"ServiceAccount", "ConfigMap", "Secret", "Service", "Deployment", "HorizontalPodAutoscaler",
         "PodDisruptionBudget"}  # fmt: skip
SECRET_KEYS = {"MEMVIT_ADMIN_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")


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
