"""Tenant API keys: who may read and who may change which adapters.

One service serves many customers' fine-tunes on one base, so one admin token is not enough: a key
names the adapters it covers (a glob over names, e.g. ``acme-*``) and whether it may read them,
change them, or both. Keys live in one JSON file (``MEMVIT_API_KEYS_FILE``), hashed at rest::

    {"format": "memvit.keys/1",
     "keys": [{"id": "acme", "sha256": "<hex sha256 of the key>", "names": "acme-*",
               "read": true, "write": true, "created": "2026-11-25T10:00:00+00:00",
               "weight": 2, "limits": {"images_per_second": 20, "requests_in_flight": 8}}],
     "anonymous": {"limits": {"images_per_second": 5}},
     "admin": {"weight": 1}}

``weight`` and ``limits`` (optional, on a key and on the ``anonymous`` and ``admin`` callers) are its
share of the fused passes and its limits: server/tenancy/policy.py.

The key itself is shown once, by ``memvit keys add``, and never stored, logged or returned: a request
is matched by the sha256 of the bearer value it sends. ``KeyFile`` re-reads the file when it changes
(checked at most every ``reload_seconds``), so a revoked key is refused within one interval; a file
that turns malformed keeps the last good keys and says why in the log, never opens the door.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import re
import secrets
from dataclasses import asdict, dataclass, field

from .policy import DEFAULT, Policy, PolicyError, parse_policy

log = logging.getLogger("memvit.server.keys")
FORMAT = "memvit.keys/1"
KEY_PREFIX = "mvk_"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# The callers that are not keys but are shared out, limited and metered like keys, by these ids.
RESERVED_IDS = ("admin", "anonymous")
_ENTRY_FIELDS = {"id", "sha256", "names", "read", "write", "created", "weight", "limits"}


class KeysFileError(ValueError):
    """The keys file is malformed; the message names the entry and the field."""


def hash_key(key: str) -> str:
    """The hex sha256 a key is stored and looked up by."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits), shown once to whoever creates it."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ApiKey:
    """One tenant key, as stored: never the key itself."""

    id: str  # a label for the log and the audit trail
    sha256: str
    names: tuple[str, ...]  # globs over adapter names (fnmatch, case-sensitive); ("*",) covers all
    read: bool = True
    write: bool = False
    created: str = ""
    policy: Policy = DEFAULT  # its weight and limits

    def covers(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)

    def may_read(self, name: str) -> bool:
        return self.read and self.covers(name)

    def may_write(self, name: str) -> bool:
        return self.write and self.covers(name)

    def to_json(self) -> dict:
        entry = {k: v for k, v in asdict(self).items() if k != "policy"}
        entry["names"] = self.names[0] if len(self.names) == 1 else list(self.names)
        return {**entry, **self.policy.to_json()}


@dataclass(frozen=True)
class KeyRing:
    """The keys of one version of the file, looked up by hash; the policies of the callers without one."""

    keys: tuple[ApiKey, ...] = ()
    anonymous: Policy = DEFAULT
    admin: Policy = DEFAULT
    _by_hash: dict[str, ApiKey] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_hash.update({k.sha256: k for k in self.keys})

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key whose hash the presented bearer value has, or None. A dict lookup on a sha256 leaks
        nothing useful through timing: finding a hash's neighbours does not help find a key."""
        return self._by_hash.get(hash_key(presented))

    def by_id(self, key_id: str) -> ApiKey | None:
        return next((k for k in self.keys if k.id == key_id), None)

    @classmethod
    def parse(cls, text: str, where: str = "keys file") -> KeyRing:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KeysFileError(f"{where}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise KeysFileError(f'{where}: expected an object with "format": "{FORMAT}"')
        if unknown := set(doc) - {"format", "keys", *RESERVED_IDS}:
            raise KeysFileError(f"{where}: unknown field(s) {sorted(unknown)}")
        entries = doc.get("keys")
        if not isinstance(entries, list):
            raise KeysFileError(f"{where}: 'keys' must be a list")
        keys = [parse_entry(entry, f"{where}: keys[{i}]") for i, entry in enumerate(entries)]
        callers = {name: parse_caller(doc.get(name, {}), f"{where}: {name}") for name in RESERVED_IDS}
        for what in ("id", "sha256"):
            seen: set[str] = set()
            for key in keys:
                value = getattr(key, what)
                if value in seen:
                    raise KeysFileError(
                        f"{where}: two keys share the {what} {value if what == 'id' else '…'}"
                    )
                seen.add(value)
        return cls(tuple(keys), **callers)

    def policy_of(self, caller: str) -> Policy:
        """The policy of ``anonymous`` or ``admin``."""
        return self.admin if caller == "admin" else self.anonymous

    def replace(self, **changes: object) -> KeyRing:
        """This ring with some of ``keys``, ``anonymous`` and ``admin`` replaced."""
        current = {"keys": self.keys, "anonymous": self.anonymous, "admin": self.admin}
        return KeyRing(**{**current, **changes})

    def dumps(self) -> str:
        doc: dict = {"format": FORMAT, "keys": [k.to_json() for k in self.keys]}
        for name in RESERVED_IDS:
            if policy := self.policy_of(name).to_json():
                doc[name] = policy
        return json.dumps(doc, indent=2) + "\n"


def parse_caller(entry: object, where: str) -> Policy:
    if not isinstance(entry, dict) or set(entry) - {"weight", "limits"}:
        raise KeysFileError(f"{where}: an object with 'weight' and/or 'limits'")
    try:
        return parse_policy(entry, where)
    except PolicyError as exc:
        raise KeysFileError(str(exc)) from None


def parse_entry(entry: object, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: must be an object")
    unknown = set(entry) - _ENTRY_FIELDS
    if unknown:
        raise KeysFileError(f"{where}: unknown field(s) {sorted(unknown)}")
    key_id, digest, names = entry.get("id"), entry.get("sha256"), entry.get("names")
    if not isinstance(key_id, str) or not _ID.match(key_id):
        raise KeysFileError(f"{where}.id: 1-64 letters, digits, '.', '_' or '-', got {key_id!r}")
    if key_id in RESERVED_IDS:
        raise KeysFileError(
            f"{where}.id: {key_id!r} names the {key_id} caller (its weight and limits are the file's "
            f"{key_id!r} object); pick another id"
        )
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise KeysFileError(f"{where}.sha256: the lower-case hex sha256 of the key (64 characters)")
    patterns = [names] if isinstance(names, str) else names
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise KeysFileError(f"{where}.names: a glob over adapter names (e.g. 'acme-*') or a list of them")
    flags = {}
    for flag, default in (("read", True), ("write", False)):
        value = entry.get(flag, default)
        if not isinstance(value, bool):
            raise KeysFileError(f"{where}.{flag}: true or false, got {value!r}")
        flags[flag] = value
    created = entry.get("created", "")
    if not isinstance(created, str):
        raise KeysFileError(f"{where}.created: a string")
    try:
        policy = parse_policy(entry, where)
    except PolicyError as exc:
        raise KeysFileError(str(exc)) from None
    return ApiKey(key_id, digest, tuple(patterns), flags["read"], flags["write"], created, policy)
