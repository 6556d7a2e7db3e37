"""A strict offline check of Kubernetes objects against the API's own schema, as the official
``kubernetes`` Python client carries it (37.x: one generated model per API type).

``validate(obj)`` finds the model for the object's apiVersion and kind through the client's API
classes (``AppsV1Api.create_namespaced_deployment`` takes a ``V1Deployment``), so an apiVersion the
API no longer serves (``autoscaling/v2beta2``) or a kind in the wrong group is an error. It then walks
the object against the model's ``openapi_types`` and ``attribute_map``: a field the schema does not
have (a typo, or the Python name ``env_from`` for ``envFrom``) is an error, every value must have the
schema's type, required fields must be present, and int-or-string fields take an int or a string.

One place is stricter than the API server: quantities (``cpu``, ``memory``) are strings in the
schema and must be written as strings here ("4", not 4), as ``kubectl get -o yaml`` prints them.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import inspect
import re
import typing
from typing import Any

import kubernetes.client

_LIST = re.compile(r"List\[(.+)\]")
_DICT = re.compile(r"Dict\[str, (.+)\]")


class SchemaError(ValueError):
    """The object's apiVersion and kind name no type of the Kubernetes API."""


def model_for(api_version: str, kind: str) -> type:
    """The client's model for ``apiVersion``/``kind`` (``apps/v1``, ``Deployment`` -> ``V1Deployment``)."""
    group, _, version = api_version.rpartition("/")
    # "" -> Core, "apps" -> Apps, "rbac.authorization.k8s.io" -> RbacAuthorization.
    group_name = "".join(part.capitalize() for part in group.removesuffix(".k8s.io").split(".")) or "Core"
    api = getattr(kubernetes.client, f"{group_name}{version.capitalize()}Api", None)
    if api is None:
        raise SchemaError(f"apiVersion {api_version!r} is not served by the Kubernetes API")
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", kind).lower()
    for method in (f"create_namespaced_{snake}", f"create_{snake}"):
        if hasattr(api, method):
            body = inspect.signature(getattr(api, method)).parameters["body"].annotation
            return getattr(kubernetes.client, body) if isinstance(body, str) else body
    raise SchemaError(f"apiVersion {api_version!r} has no kind {kind!r}")


def validate(obj: Any) -> list[str]:
    """Every way ``obj`` departs from the schema of its apiVersion and kind, one line each."""
    if not isinstance(obj, dict) or not isinstance(obj.get("apiVersion"), str) or not obj.get("kind"):
        return ["an object needs apiVersion and kind"]
    try:
        model = model_for(obj["apiVersion"], obj["kind"])
    except SchemaError as exc:
        return [str(exc)]
    errors: list[str] = []
    _check_model(obj, model, obj["kind"], errors)
    return errors


def _check_model(value: Any, model: type, path: str, errors: list[str]) -> None:
    if not isinstance(value, dict):
        errors.append(f"{path}: expected an object ({model.__name__}), got {type(value).__name__}")
        return
    wire_to_attr = {wire: attr for attr, wire in model.attribute_map.items()}
    for key, item in value.items():
        attr = wire_to_attr.get(key)
        if attr is None:
            errors.append(f"{path}: unknown field {key!r} in {model.__name__}")
            continue
        type_name = model.openapi_types[attr]
        if type_name == "object":
            _check_object(item, _int_or_string(model, attr), f"{path}.{key}", errors)
        else:
            _check(item, type_name, f"{path}.{key}", errors)
    for attr, field in getattr(model, "model_fields", {}).items():
        if field.is_required() and model.attribute_map[attr] not in value:
            errors.append(f"{path}: missing required field {model.attribute_map[attr]!r}")


def _check(value: Any, type_name: str, path: str, errors: list[str]) -> None:
    if value is None:  # the API reads null as "unset"; written out, it is a mistake
        errors.append(f"{path}: null where {type_name} is expected")
    elif match := _LIST.fullmatch(type_name):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check(item, match.group(1), f"{path}[{i}]", errors)
    elif match := _DICT.fullmatch(type_name):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: map key {key!r} is not a string")
            _check(item, match.group(1), f"{path}[{key!r}]", errors)
    elif type_name in _PRIMITIVES:
        if not _PRIMITIVES[type_name](value):
            expected = "base64 text" if type_name == "bytes" else type_name
            errors.append(f"{path}: expected {expected}, got {type(value).__name__} {value!r}")
    elif (model := getattr(kubernetes.client, type_name, None)) is not None:
        _check_model(value, model, path, errors)
    else:  # a type this walker does not know: fail loudly rather than pass anything
        errors.append(f"{path}: no model for type {type_name!r} in the kubernetes client")


def _check_object(value: Any, int_or_string: bool, path: str, errors: list[str]) -> None:
    if int_or_string and (isinstance(value, bool) or not isinstance(value, (int, str))):
        errors.append(f"{path}: expected an int or a string, got {type(value).__name__} {value!r}")
    # Otherwise free-form JSON (an embedded raw object): any value is schema-valid.


def _int_or_string(model: type, attr: str) -> bool:
    """Whether the schema's ``object`` field is an IntOrString (the client types it int | str)."""
    field = getattr(model, "model_fields", {}).get(attr)
    if field is None:
        return False
    bases = {typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
             for a in typing.get_args(field.annotation)} - {type(None)}  # fmt: skip
    return bases == {int, str}


def _is_base64(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        base64.b64decode(value, validate=True)
    except binascii.Error:
        return False
    return True


_PRIMITIVES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    # YAML reads an unquoted RFC 3339 time as a datetime; the API takes either form.
    "datetime": lambda v: isinstance(v, (str, datetime.datetime)),
    "bytes": _is_base64,  # Secret data: base64 text
}
