"""The Kubernetes API schema check (k8s_schema.py: the official client's models) on every object the
manifests render, and the validator itself: it rejects what the API would and takes what it takes."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the kubernetes client is not installed (pip install -e '.[dev]')")

from .k8s_render import K8S, KINDS, TARGETS, _pod
from .k8s_schema import validate


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
