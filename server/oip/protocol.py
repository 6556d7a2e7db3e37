"""The Open Inference Protocol's wire format (KServe v2 / Triton HTTP): requests in, responses out.

Pure functions, no HTTP and no model: an infer request (JSON, or JSON followed by binary tensor data
when ``Inference-Header-Content-Length`` is sent) is parsed into named tensors, and outputs are
encoded back, as JSON ``data`` or, where the client asked for it, as binary data after the JSON
header (the binary tensor data extension). Triton's classification extension formats the top k of
an output as BYTES strings ``"<value>:<index>:<label>"``.

Datatypes used here: ``BYTES`` (each element a byte string: in binary data, a 4-byte little-endian
length then the bytes) and ``FP32`` (little-endian float32); other datatypes are refused with the
reason.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ServiceError

HEADER_LENGTH = "inference-header-content-length"
_NUMPY = {"FP32": np.dtype("<f4")}


class ProtocolError(ServiceError):
    """A request the protocol cannot accept (malformed JSON, a shape that does not match its data)."""

    status = 400


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool = False
    class_count: int = 0  # > 0: the classification extension's top k instead of the tensor


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]  # name -> FP32 array, or an object array of bytes for BYTES
    outputs: list[RequestedOutput] = field(default_factory=list)  # empty: every output, as JSON
    binary_outputs: bool = False  # the request's own ``binary_data_output`` parameter


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """An infer request's body -> its inputs and requested outputs. ``header_length``: the
    ``Inference-Header-Content-Length`` header's value (the JSON part's size), or None for all-JSON."""
    if header_length is None:
        header_length = len(body)
    if not 0 <= header_length <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH} is {header_length}, but the body has {len(body)} bytes")
    try:
        doc = json.loads(body[:header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"the inference request is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise ProtocolError("an inference request is an object with a non-empty 'inputs' list")
    binary = memoryview(body)[header_length:]
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, spec in enumerate(doc["inputs"]):
        name, array, used = _parse_input(spec, binary[offset:], f"inputs[{i}]")
        if name in inputs:
            raise ProtocolError(f"input {name!r} is given twice")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data belong to no input")
    params = _parameters(doc, "request")
    outputs = [_parse_output(spec, f"outputs[{i}]") for i, spec in enumerate(doc.get("outputs") or [])]
    request_id = doc.get("id")
    return InferRequest(
        id=str(request_id) if request_id is not None else None,
        inputs=inputs,
        outputs=outputs,
        binary_outputs=bool(params.get("binary_data_output", False)),
    )


def _parse_input(spec: Any, binary: memoryview, where: str) -> tuple[str, np.ndarray, int]:
    if not isinstance(spec, dict):
        raise ProtocolError(f"{where}: must be an object with name, datatype, shape")
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}: 'name' must be a non-empty string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"input {name!r}: 'shape' must be a list of non-negative integers")
    count = int(np.prod(shape)) if shape else 1
    size = _parameters(spec, f"input {name!r}").get("binary_data_size")
    if datatype == "BYTES":
        if size is not None:
            items, used = _bytes_elements(binary, _size(size, name), count, name)
        else:
            items, used = [_utf8(v, name) for v in _flat(spec.get("data"), name)], 0
        if len(items) != count:
            raise ProtocolError(
                f"input {name!r}: shape {shape} holds {count} elements, the data has {len(items)}"
            )
        array = np.empty(count, dtype=object)
        array[:] = items
        return name, array.reshape(shape), used
    dtype = _NUMPY.get(datatype)
    if dtype is None:
        raise ProtocolError(f"input {name!r}: datatype {datatype!r} is not accepted (use BYTES or FP32)")
    if size is not None:
        used = _size(size, name)
        if used != count * dtype.itemsize or used > len(binary):
            raise ProtocolError(
                f"input {name!r}: {used} bytes of binary data do not hold shape {shape} {datatype}"
            )
        return name, np.frombuffer(binary[:used], dtype=dtype).reshape(shape).copy(), used
    values = _flat(spec.get("data"), name)
    if len(values) != count or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise ProtocolError(f"input {name!r}: shape {shape} needs {count} numbers in 'data'")
    return name, np.asarray(values, dtype=dtype).reshape(shape), 0


def _parse_output(spec: Any, where: str) -> RequestedOutput:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ProtocolError(f"{where}: must be an object with a 'name'")
    params = _parameters(spec, f"output {spec['name']!r}")
    count = params.get("classification", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ProtocolError(f"output {spec['name']!r}: 'classification' must be a non-negative integer")
    return RequestedOutput(spec["name"], binary=bool(params.get("binary_data", False)), class_count=count)


def _parameters(doc: dict, where: str) -> dict:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object")
    return params


def _size(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"input {name!r}: 'binary_data_size' must be a non-negative integer")
    return value


def _flat(data: Any, name: str) -> list:
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: needs 'data' (a list) or binary data ('binary_data_size')")
    flat: list = []
    stack = [data]
    while stack:  # row-major flattening of nested lists, as the protocol allows
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    return flat


def _utf8(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError(f"input {name!r}: BYTES elements in JSON are strings")
    return value.encode()


def _bytes_elements(binary: memoryview, size: int, count: int, name: str) -> tuple[list[bytes], int]:
    if size > len(binary):
        raise ProtocolError(f"input {name!r}: binary_data_size {size} is past the end of the body")
    items, pos = [], 0
    while pos < size:
        if pos + 4 > size:
            raise ProtocolError(f"input {name!r}: a BYTES element's 4-byte length is cut off")
        (length,) = struct.unpack_from("<I", binary, pos)
        pos += 4
        if pos + length > size:
            raise ProtocolError(f"input {name!r}: a BYTES element runs past its binary data")
        items.append(bytes(binary[pos : pos + length]))
        pos += length
    return items, size


# -- responses ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str  # FP32 or BYTES
    array: np.ndarray


def classification(logits: np.ndarray, labels: tuple[str, ...] | None, k: int) -> np.ndarray:
    """Triton's classification extension: (B, C) -> (B, k) object array of ``"value:index:label"``."""
    k = min(k, logits.shape[-1])
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    out = np.empty(order.shape, dtype=object)
    for b in range(order.shape[0]):
        for j, index in enumerate(order[b]):
            label = labels[index] if labels is not None and index < len(labels) else f"class_{index}"
            out[b, j] = f"{logits[b, index]}:{int(index)}:{label}".encode()
    return out


def encode_infer_response(
    model: str, request: InferRequest, outputs: list[OutputTensor], binary: set[str]
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers; outputs named in ``binary`` go as binary data after the JSON."""
    described, blobs = [], []
    for out in outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        if out.name in binary:
            blob = _to_bytes(out)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif out.datatype == "BYTES":
            entry["data"] = [v.decode("utf-8", "replace") for v in out.array.reshape(-1)]
        else:
            entry["data"] = out.array.reshape(-1).tolist()
        described.append(entry)
    doc: dict[str, Any] = {"model_name": model, "outputs": described}
    if request.id is not None:
        doc["id"] = request.id
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, {"content-type": "application/json"}
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return b"".join([header, *blobs]), headers


def _to_bytes(out: OutputTensor) -> bytes:
    if out.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in out.array.reshape(-1))
    return np.ascontiguousarray(out.array, dtype=_NUMPY[out.datatype]).tobytes()
