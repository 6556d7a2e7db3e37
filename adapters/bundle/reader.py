"""Reading a bundle: parse the safetensors container, then map its fields onto ``AdapterWeights``.

This module checks only what belongs to the container and the format: the header's structure, the
format tag, which metadata keys and tensors exist, that the fingerprint looks like one, that JSON
fields parse. Every rule about the adapter itself (name, parent, memory placement, labels, shapes,
finite values) is ``AdapterWeights``'s, and its errors are re-raised here as ``BundleError``s naming
the bundle's field. The header is parsed before safetensors touches the bytes, so a file that is not
safetensors at all, a truncated one and one that is merely not a memvit bundle each get their own
message. Nothing here ever unpickles anything.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load

from memvit.memory_core import AdapterWeights
from memvit.memory_core.errors import InvalidAdapterError

from .errors import BundleFormatError, BundleMetadataError, BundleTensorError
from .format import FORMAT, OPTIONAL_METADATA, REQUIRED_METADATA, TENSOR_FIELDS, TENSOR_LAYOUT, AdapterBundle

MAX_HEADER_BYTES = 16 * 1024 * 1024  # a bundle header lists 4 tensors; anything huge is not one
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
_TENSOR_NAMES = {attr: name for name, attr in TENSOR_FIELDS.items()}  # AdapterWeights attribute -> tensor


def read_bundle(source: str | Path | bytes, *, max_bytes: int | None = None) -> AdapterBundle:
    """Parse and validate a bundle from a path or bytes. Raises a ``BundleError`` subclass."""
    data, where = _read(source, max_bytes)
    header = _parse_header(data, where)
    meta = _check_metadata(header.pop("__metadata__", None), where)
    _check_tensor_entries(header, where)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, TypeError, OverflowError) as exc:  # offsets overlap, misaligned...
        raise BundleFormatError(f"{where}: not a valid safetensors file ({exc})") from exc
    try:
        weights = AdapterWeights(
            name=meta["name"],
            **{attr: tensors[name].float() for name, attr in TENSOR_FIELDS.items()},
            memory_norm=meta["memory_norm"],
            parent=meta.get("parent"),
            labels=tuple(meta["labels"]),
        )
    except InvalidAdapterError as exc:
        field = _TENSOR_NAMES.get(exc.field or "", exc.field)
        kind = BundleTensorError if field in TENSOR_LAYOUT else BundleMetadataError
        message = str(exc)
        for attr, name in _TENSOR_NAMES.items():
            message = message.replace(attr, name)
        raise kind(f"{where}: {message}", field=field) from exc
    return AdapterBundle(
        weights=weights,
        base_model=meta["base_model"],
        base_fingerprint=meta["base_fingerprint"],
        training=meta.get("training"),
    )


def _read(source: str | Path | bytes, max_bytes: int | None) -> tuple[bytes, str]:
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
    return data, where


def _parse_header(data: bytes, where: str) -> dict[str, Any]:
    """The JSON header, with every tensor entry's structure checked (dtype, shape, two offsets)."""
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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BundleFormatError(f"{not_st} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise BundleFormatError(f"{not_st} (its header is not a JSON object)")
    have = len(data) - 8 - n
    for key, entry in header.items():
        if key != "__metadata__":
            _check_entry(key, entry, have, where)
    return header


def _check_entry(key: str, entry: Any, have: int, where: str) -> None:
    bad = f"{where}: tensor {key!r} has a malformed header entry"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BundleFormatError(f"{bad} (expected dtype, shape and data_offsets)", field=key)
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(entry["dtype"], str):
        raise BundleFormatError(f"{bad} (dtype is not a string)", field=key)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise BundleFormatError(f"{bad} (shape is not a list of non-negative integers)", field=key)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise BundleFormatError(f"{bad} (data_offsets is not two non-negative integers)", field=key)
    if offsets[0] > offsets[1]:
        raise BundleFormatError(f"{bad} (data_offsets end before they begin)", field=key)
    if offsets[1] > have:
        raise BundleFormatError(
            f"{where}: truncated: tensors need {offsets[1]} bytes of data, the file has {have}"
        )


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63  # not bool, not float


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
    unknown = sorted(set(meta) - set(REQUIRED_METADATA) - set(OPTIONAL_METADATA), key=str)
    if unknown:
        raise BundleMetadataError(f"{where}: unknown metadata keys {unknown}", field=str(unknown[0]))
    for key in OPTIONAL_METADATA:
        if key in meta and not isinstance(meta[key], str):
            raise BundleMetadataError(f"{where}: metadata {key!r} must be a string", field=key)
    if not _FINGERPRINT.fullmatch(meta["base_fingerprint"]):
        raise BundleMetadataError(
            f"{where}: base_fingerprint is not a sha256 hex digest", field="base_fingerprint"
        )
    out: dict[str, Any] = dict(meta)
    out["labels"] = _json(meta, "labels", where, list)
    if "training" in meta:
        out["training"] = _json(meta, "training", where, dict)
    return out


def _json(meta: dict[str, str], key: str, where: str, kind: type) -> Any:
    try:
        value = json.loads(meta[key])
    except (json.JSONDecodeError, RecursionError):
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
        if entry["dtype"] not in FLOAT_DTYPES:
            raise BundleTensorError(
                f"{where}: tensor {key!r} has dtype {entry['dtype']}; expected a floating-point dtype "
                f"({', '.join(sorted(FLOAT_DTYPES))})",
                field=key,
            )
