"""Fuzzing the bundle reader: whatever the bytes, a bundle either reads or raises a ``BundleError``.

2,000+ seeded mutations of a valid bundle (header bytes, JSON values, the length prefix, offsets,
dtypes, shapes, metadata types, truncation, deep nesting) go through ``read_bundle`` and, when they
read, onto an engine: the only errors allowed are memvit's named ``AdapterError``s, and a refused
bundle leaves the live set exactly as it was.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import pytest

from memvit.adapters import BundleError, attach_bundle, bundle_for, read_bundle
from memvit.memory_core import AdapterError, LiveAdapters
from tests.conftest import random_adapter, tiny_engine

CASES = 2400
ODD_VALUES: list[Any] = [
    None, True, 0, -1, 1, 2**64, 3.5, float("1e308"), "", "a", "F32", "I64", "norm1",
    [], [1], [0, 0], [0, 1, 2], ["a", "b"], [None, None], [[0, 4]], [-4, 0], [4, 0], [0, 2**62],
    {}, {"a": 1}, [1.5, 2.5], [True, False],
]  # fmt: skip


def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: Any, body: bytes, *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in a JSON tree."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _set(node: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def mutate(data: bytes, rng: random.Random) -> bytes:
    header, body = _split(data)
    kind = rng.randrange(9)
    if kind == 0:  # a JSON value anywhere becomes something odd
        _set(header, rng.choice(_paths(header)), rng.choice(ODD_VALUES))
        return _join(header, body)
    if kind == 1:  # a metadata value of another JSON type (parent as an integer, ...)
        key = rng.choice(["parent", "name", "labels", "training", "memory_norm", "format", "base_model"])
        header["__metadata__"][key] = rng.choice(ODD_VALUES)
        return _join(header, body)
    if kind == 2:  # a tensor's entry: dtype, shape or offsets changed to plausible but wrong values
        entry = header[rng.choice([k for k in header if k != "__metadata__"])]
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if field == "dtype":
            entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "C64", "x"])
        elif field == "shape":
            entry["shape"] = [rng.randrange(0, 9) for _ in range(rng.randrange(0, 4))]
        else:
            a, b = (rng.randrange(0, len(body) + 64) for _ in range(2))
            entry["data_offsets"] = [a, b]
        return _join(header, body)
    if kind == 3:  # flip bytes inside the header text
        text = bytearray(json.dumps(header).encode())
        for _ in range(rng.randrange(1, 6)):
            text[rng.randrange(len(text))] = rng.randrange(256)
        return _join(header, body, raw=bytes(text))
    if kind == 4:  # the length prefix lies
        raw = json.dumps(header).encode()
        n = rng.choice([0, 1, len(raw) - 1, len(raw) + 1, len(raw) + len(body), 2**40, rng.randrange(2**64)])
        return struct.pack("<Q", n) + raw + body
    if kind == 5:  # truncated or padded anywhere
        cut = rng.randrange(len(data) + 1)
        return data[:cut] if rng.random() < 0.7 else data + bytes(rng.randrange(1, 64))
    if kind == 6:  # deeply nested JSON, in the header or in a metadata string
        deep = "[" * 100_000 + "]" * 100_000
        if rng.random() < 0.5:
            return _join(None, body, raw=b'{"memory": ' + deep.encode() + b"}")
        header["__metadata__"]["training"] = deep
        return _join(header, body)
    if kind == 7:  # keys added, removed or renamed
        target = header if rng.random() < 0.5 else header["__metadata__"]
        key = rng.choice(list(target))
        action = rng.randrange(3)
        if action == 0:
            del target[key]
        elif action == 1:
            target[key + "x"] = target.pop(key)
        else:
            target[rng.choice(["extra", "", "__metadata__", "head.weight"])] = rng.choice(ODD_VALUES)
        return _join(header, body)
    # kind 8: the tensor data itself (NaN, inf, huge, anything)
    body = bytearray(body)
    for _ in range(rng.randrange(1, 16)):
        body[rng.randrange(len(body))] = rng.randrange(256)
    return _join(header, bytes(body))


@pytest.fixture(scope="module")
def setup():
    engine = tiny_engine()
    live = LiveAdapters(engine)
    live.replace_all([random_adapter("first", engine, m=2)])
    parent = bundle_for(random_adapter("first", engine, m=2), engine)
    good = bundle_for(
        random_adapter("new", engine, m=3, classes=4, parent="first"), engine, training={"steps": 1}
    )
    return live, parent, good.to_bytes()


def test_random_mutations_read_or_raise_a_bundle_error(setup) -> None:
    live, _, good = setup
    rng = random.Random(20261123)
    outcomes = {"read": 0, "refused": 0}
    for case in range(CASES):
        data = mutate(good, rng)
        before = live.current
        try:
            bundle = read_bundle(data)
        except BundleError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"case {case}: read_bundle raised {type(exc).__name__}: {exc!r}")
        outcomes["read"] += 1
        try:
            attach_bundle(live, bundle, replace=True)
        except AdapterError:
            assert live.current is before, f"case {case}: a refused bundle changed the live set"
        except Exception as exc:  # pragma: no cover
            pytest.fail(f"case {case}: attaching raised {type(exc).__name__}: {exc!r}")
        else:
            live.replace_all([before["first"].weights])  # back to the parent alone
    assert outcomes["refused"] > CASES // 2 and outcomes["read"] > 0, outcomes


@pytest.mark.parametrize(
    "offsets",
    [["a", "b"], None, [0], [[0, 4]], [], [4, 0], [-4, 0], [0, 2.5], [True, 4]],
)
def test_the_reported_malformed_offsets_are_format_errors(setup, offsets) -> None:
    _, _, good = setup
    header, body = _split(good)
    header["memory"]["data_offsets"] = offsets
    with pytest.raises(BundleError, match=r"malformed header entry|not a valid safetensors"):
        read_bundle(_join(header, body))


def test_the_issues_reproduction_is_a_format_error() -> None:
    h = json.dumps({"memory": {"dtype": "F32", "shape": [1], "data_offsets": ["a", "b"]}}).encode()
    with pytest.raises(BundleError, match="malformed header entry"):
        read_bundle(struct.pack("<Q", len(h)) + h)


def test_parent_as_an_integer_is_a_metadata_error(setup) -> None:
    _, _, good = setup
    header, body = _split(good)
    header["__metadata__"]["parent"] = 7
    with pytest.raises(BundleError, match="'parent' must be a string"):
        read_bundle(_join(header, body))
