"""Reading a bundle strictly: every check of DESIGN 3, each failure a named error naming the field.

The safetensors header is parsed here before safetensors touches the bytes, so a file that is not
safetensors at all, one that is truncated and one that is merely not a memvit bundle each get their
own message. Nothing here ever unpickles anything.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from memory_core import BASE_TASK, MEMORY_NORMS, NAME_PATTERN, AdapterWeights
from memory_core.errors import AdapterShapeError

from .bundle import FORMAT, OPTIONAL_METADATA, REQUIRED_METADATA, TENSOR_LAYOUT, AdapterBundle
from .errors import BundleFormatError, BundleMetadataError, BundleTensorError

MAX_HEADER_BYTES = 16 * 1024 * 1024  # a bundle header lists 4 tensors; anything huge is not one
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


def read_bundle(source: str | Path | bytes, *, max_bytes: int | None = None) -> AdapterBundle:
    """Parse and validate a bundle from a path or bytes. Raises a ``BundleError`` subclass."""
    if isinstance(source, bytes | bytearray | memoryview):
        data, where = bytes(source), "bundle"
    else:
        path = Path(source)
        try:
            size = path.stat().st_size
            if max_bytes is not None and size > max_bytes:
                raise BundleFormatError(f"{path.name}: {size} bytes is over the {max_bytes}-byte limit")
            data = path.read_bytes()
        except OSError as exc:
            raise BundleFormatError(f"cannot read {path}: {exc.strerror or exc}") from exc
        where = path.name
    if max_bytes is not None and len(data) > max_bytes:
        raise BundleFormatError(f"{where}: {len(data)} bytes is over the {max_bytes}-byte limit")

    header = _parse_header(data, where)
    meta = _check_metadata(header.pop("__metadata__", None), where)
    _check_tensor_entries(header, where)
    try:
        tensors = load(data)
    except SafetensorError as exc:  # offsets overlap, misaligned, ...: checked above, but be safe
        raise BundleFormatError(f"{where}: not a valid safetensors file ({exc})") from exc

    for key, t in tensors.items():
        if not torch.isfinite(t).all():
            raise BundleTensorError(f"{where}: tensor {key!r} contains NaN or inf", field=key)
    tensors = {k: t.float() for k, t in tensors.items()}
    labels = meta["labels"]
    rows = tensors["head.weight"].shape[0] if tensors["head.weight"].ndim == 2 else None
    if rows is not None and len(labels) != rows:
        raise BundleMetadataError(
            f"{where}: {len(labels)} labels for a head of {rows} classes (head.weight has {rows} rows)",
            field="labels",
        )
    try:
        weights = AdapterWeights(
            name=meta["name"],
            memory=tensors["memory"],
            cls_token=tensors["cls_token"],
            head_weight=tensors["head.weight"],
            head_bias=tensors["head.bias"],
            memory_norm=meta["memory_norm"],
            parent=meta.get("parent"),
            labels=tuple(labels),
        )
    except AdapterShapeError as exc:  # shapes that do not fit each other
        field = {"head_weight": "head.weight", "head_bias": "head.bias"}.get(exc.field, exc.field)
        raise BundleTensorError(f"{where}: {exc}", field=field) from exc
    return AdapterBundle(
        weights=weights,
        base_model=meta["base_model"],
        base_fingerprint=meta["base_fingerprint"],
        training=meta.get("training"),
    )


def _parse_header(data: bytes, where: str) -> dict[str, Any]:
    not_st = f"{where}: not a safetensors file"
    if len(data) < 8:
        raise BundleFormatError(f"{not_st} ({len(data)} bytes is too short for a header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or n < 2:
        raise BundleFormatError(f"{not_st} (first 8 bytes are not a plausible header length)")
    if 8 + n > len(data):
        raise BundleFormatError(
            f"{where}: truncated: the header needs {n} bytes, the file has {len(data) - 8}"
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BundleFormatError(f"{not_st} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise BundleFormatError(f"{not_st} (its header is not a JSON object)")
    ends = [
        e["data_offsets"][1]
        for k, e in header.items()
        if k != "__metadata__" and isinstance(e, dict) and isinstance(e.get("data_offsets"), list)
    ]
    have = len(data) - 8 - n
    if ends and max(ends) > have:
        raise BundleFormatError(
            f"{where}: truncated: tensors need {max(ends)} bytes of data, the file has {have}"
        )
    return header


def _check_metadata(meta: Any, where: str) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise BundleFormatError(f"{where}: no metadata; not a {FORMAT} bundle", field="format")
    if meta.get("format") != FORMAT:
        raise BundleFormatError(
            f"{where}: unknown format {meta.get('format')!r}; expected {FORMAT!r}", field="format"
        )
    for key in REQUIRED_METADATA:
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise BundleMetadataError(f"{where}: metadata {key!r} is missing or empty", field=key)
    unknown = sorted(set(meta) - set(REQUIRED_METADATA) - set(OPTIONAL_METADATA))
    if unknown:
        raise BundleMetadataError(f"{where}: unknown metadata keys {unknown}", field=unknown[0])
    out: dict[str, Any] = dict(meta)
    for key in ("name", "parent"):
        if key in meta:
            value = meta[key]
            if not NAME_PATTERN.fullmatch(value) or value == BASE_TASK:
                raise BundleMetadataError(
                    f"{where}: invalid {key} {value!r}: use 1-64 characters from a-z, 0-9, '.', '_', '-', "
                    f"starting with a letter or digit (and not {BASE_TASK!r})",
                    field=key,
                )
    if meta.get("parent") == meta["name"]:
        raise BundleMetadataError(f"{where}: adapter {meta['name']!r} names itself as parent", field="parent")
    if meta["memory_norm"] not in MEMORY_NORMS:
        raise BundleMetadataError(
            f"{where}: memory_norm must be one of {list(MEMORY_NORMS)}, got {meta['memory_norm']!r}",
            field="memory_norm",
        )
    if not _FINGERPRINT.fullmatch(meta["base_fingerprint"]):
        raise BundleMetadataError(
            f"{where}: base_fingerprint is not a sha256 hex digest", field="base_fingerprint"
        )
    out["labels"] = _json(meta, "labels", where, list)
    if not all(isinstance(x, str) for x in out["labels"]):
        raise BundleMetadataError(f"{where}: labels must be a JSON list of strings", field="labels")
    if "training" in meta:
        out["training"] = _json(meta, "training", where, dict)
    return out


def _json(meta: dict[str, str], key: str, where: str, kind: type) -> Any:
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError:
        raise BundleMetadataError(f"{where}: metadata {key!r} is not valid JSON", field=key) from None
    if not isinstance(value, kind):
        raise BundleMetadataError(f"{where}: metadata {key!r} must be a JSON {kind.__name__}", field=key)
    return value


def _check_tensor_entries(header: dict[str, Any], where: str) -> None:
    for key in TENSOR_LAYOUT:
        if key not in header:
            raise BundleTensorError(f"{where}: missing tensor {key!r} {TENSOR_LAYOUT[key]}", field=key)
    for key, entry in header.items():
        if key not in TENSOR_LAYOUT:
            raise BundleTensorError(f"{where}: unexpected tensor {key!r}", field=key)
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in FLOAT_DTYPES:
            raise BundleTensorError(
                f"{where}: tensor {key!r} has dtype {dtype}; expected a floating-point dtype "
                f"({', '.join(sorted(FLOAT_DTYPES))})",
                field=key,
            )
