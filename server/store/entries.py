"""What the journal and the index hold: one ``Entry`` per change, and ``Snapshot``, the registry
after ``generation`` changes (docs/design.md §4).

Both are plain JSON. An entry carries everything the registry lists about an adapter (no bundle is
read to list it) and the key and SHA-256 of its bundle object, so a replica loading it on demand
reads exactly those bytes and can tell if they are not the ones registered.

The index is written in columns, with the values many adapters share (label sets, bases, their
fingerprints) in tables: 100,000 adapters are about 20 MB of JSON that a replica parses in a fraction
of a second, where one object per adapter was 48 MB and several seconds.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memvit.memory_core import NAME_PATTERN

from .base import StoreUnavailableError

INDEX_FORMAT = "memvit.index/1"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PUT_FIELDS = ("key", "size", "sha256", "parent", "memory_tokens", "memory_norm", "labels")
_TABLES = ("memory_norm", "labels", "base_model", "base_fingerprint")


class JournalDamagedError(StoreUnavailableError):
    """A journal entry, the index or the journal's base cannot be parsed.

    Never skipped (a replica that skipped an entry would serve another registry than its peers
    under the same version): changes are refused with this 503 until an operator repairs the
    object, while the adapters already known keep being served.
    """


class Entry(NamedTuple):
    """One change: ``put`` registers (or replaces) ``name`` with the bundle at ``key``; ``delete``
    removes it, or the invalid object at ``key``. A tuple: 100,000 of them are built at start-up."""

    op: str  # "put" | "delete"
    name: str
    key: str | None = None
    size: int = 0
    sha256: str = ""
    parent: str | None = None
    memory_tokens: int = 0
    memory_norm: str = ""
    labels: tuple[str, ...] = ()
    base_model: str = ""
    base_fingerprint: str = ""
    time: float = 0.0

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def to_json(self) -> dict[str, Any]:
        data = self._asdict()
        data["labels"] = list(self.labels)
        return data

    @classmethod
    def from_json(cls, data: object) -> Entry:
        """Parse one journal entry; anything that is not a well-formed entry raises ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        op, name = data.get("op"), data.get("name")
        if op not in ("put", "delete"):
            raise ValueError(f"op {op!r} is neither put nor delete")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"name {name!r} is not an adapter name")
        if op == "delete":
            key = data.get("key")
            if key is not None and not isinstance(key, str):
                raise ValueError("key is not a string")
            return cls("delete", name, key, time=float(data.get("time") or 0.0))
        if missing := [f for f in _PUT_FIELDS if f not in data]:
            raise ValueError(f"missing {missing}")
        labels = data["labels"]
        if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
            raise ValueError("labels is not a list of strings")
        if not isinstance(data["key"], str) or not _SHA256.fullmatch(str(data["sha256"])):
            raise ValueError("key or sha256 malformed")
        parent = data["parent"]
        if parent is not None and not isinstance(parent, str):
            raise ValueError("parent is not a string")
        intern = sys.intern
        return cls(
            "put",
            name,
            data["key"],
            int(data["size"]),
            data["sha256"],
            parent,
            int(data["memory_tokens"]),
            intern(str(data["memory_norm"])),
            tuple(intern(label) for label in labels),
            intern(str(data.get("base_model", ""))),
            intern(str(data.get("base_fingerprint", ""))),
            float(data.get("time") or 0.0),
        )


# The index's columns, in order: every field of ``Entry`` but ``op`` (an index row is a put's entry,
# ``op`` left out), so a row is the entry's fields and the entry is built from the row in one step.
# Those in _TABLES hold an index into the table of that name.
COLUMNS = Entry._fields[1:]


def parse_entry(raw: bytes, where: str) -> Entry:
    try:
        return Entry.from_json(json.loads(raw))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise JournalDamagedError(f"{where} is damaged ({exc}): it cannot be skipped") from None


@dataclass
class Snapshot:
    """The registry after ``generation`` changes: adapters by name, and objects that are not valid
    bundles (found when a store written before the journal was migrated) by key, with the reason."""

    generation: int = 0
    adapters: dict[str, Entry] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)

    def apply(self, generation: int, entry: Entry) -> Entry | None:
        """Apply change ``generation`` (the next one). Returns the entry it replaced or removed.

        Total and deterministic, so every replica applying the same entries holds the same state;
        the writer checked the change against this very state before claiming its slot.
        """
        if generation != self.generation + 1:
            raise ValueError(f"change {generation} applied to a registry at {self.generation}")
        self.generation = generation
        if entry.key is not None:
            self.invalid.pop(entry.key, None)
        if entry.op == "put":
            before, self.adapters[entry.name] = self.adapters.get(entry.name), entry
            return before
        return self.adapters.pop(entry.name, None)

    def copy(self) -> Snapshot:
        return Snapshot(self.generation, dict(self.adapters), dict(self.invalid))

    def to_bytes(self) -> bytes:
        tables: dict[str, dict[Any, int]] = {name: {} for name in _TABLES}
        rows = []
        for e in self.adapters.values():
            row: list[Any] = list(e[1:])  # every field but op, in COLUMNS' order
            for column in _TABLES:
                i = COLUMNS.index(column)
                row[i] = tables[column].setdefault(row[i], len(tables[column]))
            rows.append(row)
        body = {
            "format": INDEX_FORMAT,
            "generation": self.generation,
            "columns": COLUMNS,
            "tables": {
                name: [list(v) if isinstance(v, tuple) else v for v in t] for name, t in tables.items()
            },
            "adapters": rows,
            "invalid": self.invalid,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Snapshot:
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT:
                raise ValueError(f"format is not {INDEX_FORMAT}")
            generation = body["generation"]
            if not isinstance(generation, int) or generation < 0:
                raise ValueError(f"generation {generation!r}")
            if tuple(body["columns"]) != COLUMNS:
                raise ValueError(f"columns {body['columns']} are not {list(COLUMNS)}")
            tables = body["tables"]
            # Each table's values, interned (labels as tuples), by the column that indexes into it.
            lookups = [
                (
                    COLUMNS.index(column),
                    [
                        tuple(sys.intern(str(x)) for x in v) if column == "labels" else sys.intern(str(v))
                        for v in tables[column]
                    ],
                )
                for column in _TABLES
            ]
            (n, norms), (lab, labels), (b, bases), (f, prints) = lookups  # _TABLES' four columns
            make = Entry._make
            adapters = {}
            for row in body["adapters"]:
                row[n], row[lab], row[b], row[f] = (
                    norms[row[n]],
                    labels[row[lab]],
                    bases[row[b]],
                    prints[row[f]],
                )
                adapters[row[0]] = make(("put", *row))  # a row is the entry's fields (TypeError if not all)
            invalid = {str(k): str(v) for k, v in body.get("invalid", {}).items()}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, UnicodeDecodeError) as exc:
            raise JournalDamagedError(f"{where} is damaged ({exc})") from None
        return cls(generation, adapters, invalid)


def dependents(adapters: dict[str, Entry], name: str) -> Iterator[str]:
    """Registered adapters that extend ``name`` directly (a scan: only changes call it)."""
    return (n for n, e in adapters.items() if e.parent == name)
