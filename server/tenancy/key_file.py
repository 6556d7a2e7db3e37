"""The keys file on disk: watched and re-read when it changes (``KeyFile``), and the changes
``memvit keys`` makes to it (add, revoke, set a policy), each written atomically.

The file's format, the ring it parses to and the keys themselves are keys.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from memvit.adapters.files import write_atomic

from .keys import RESERVED_IDS, ApiKey, KeyRing, KeysFileError, hash_key, new_key, parse_caller, parse_entry
from .policy import DEFAULT, Policy

log = logging.getLogger("memvit.server.keys")


class KeyFile:
    """A keys file watched for changes: ``ring()`` is the current keys, re-read when the file changed.

    ``stat`` costs microseconds, but it is still only looked at every ``reload_seconds``: a request
    path that asks ``ring()`` on every call pays a clock read, nothing more, between checks.
    """

    def __init__(
        self, path: str | Path, *, reload_seconds: float = 2.0, clock: Callable[[], float] = time.monotonic
    ):
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._signature: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._ring = self._read()  # at start-up a bad or missing file is fatal: raise here

    def ring(self) -> KeyRing:
        now = self._clock()
        if now - self._checked < self.reload_seconds:
            return self._ring
        with self._lock:
            if now - self._checked >= self.reload_seconds:
                self._checked = now
                self._reload_if_changed()
        return self._ring

    def _reload_if_changed(self) -> None:
        try:
            signature = self._stat()
        except OSError as exc:
            log.error(
                "keys file %s cannot be read (%s); keeping the %d keys loaded",
                self.path,
                exc,
                len(self._ring),
            )
            return
        if signature == self._signature:
            return
        try:
            self._ring = self._read()
            log.info("keys file %s reloaded: %d keys", self.path, len(self._ring))
        except (OSError, KeysFileError) as exc:
            log.error(
                "keys file %s is invalid (%s); keeping the %d keys loaded", self.path, exc, len(self._ring)
            )

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> KeyRing:
        signature = self._stat()
        ring = KeyRing.parse(self.path.read_text(encoding="utf-8"), str(self.path))
        self._signature = signature
        return ring


# -- managing the file (memvit keys add/list/revoke) -------------------------------------------------
def load_or_empty(path: Path) -> KeyRing:
    return KeyRing.parse(path.read_text(encoding="utf-8"), str(path)) if path.exists() else KeyRing()


def write_ring(path: Path, ring: KeyRing) -> None:
    """Atomically replace ``path``, readable by its owner only: a reader sees the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, ring.dumps().encode(), mode=0o600)


def add_key(
    path: Path, key_id: str, names: Iterable[str], *, read: bool, write: bool, policy: Policy = DEFAULT
) -> str:
    """Adds a key (with ``policy``: its weight and limits) to the file and returns it (the only time
    it is ever seen)."""
    ring = load_or_empty(path)
    if ring.by_id(key_id) is not None:
        raise KeysFileError(f"a key with id {key_id!r} exists already; revoke it first or pick another id")
    key = new_key()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    entry = parse_entry(
        {"id": key_id, "sha256": hash_key(key), "names": list(names), "read": read, "write": write,
         "created": created, **policy.to_json()},
        f"new key {key_id!r}",
    )  # fmt: skip
    write_ring(path, ring.replace(keys=(*ring.keys, entry)))
    return key


def revoke_key(path: Path, key_id: str) -> ApiKey:
    ring = load_or_empty(path)
    gone = ring.by_id(key_id)
    if gone is None:
        raise KeysFileError(f"no key with id {key_id!r} in {path}")
    write_ring(path, ring.replace(keys=tuple(k for k in ring.keys if k.id != key_id)))
    return gone


def set_policy(path: Path, who: str, policy: Policy) -> None:
    """Give key ``who`` (or the ``anonymous`` or ``admin`` caller) ``policy``; a running server
    applies it within one reload interval, as it does a revocation."""
    ring = load_or_empty(path)
    checked = parse_caller(policy.to_json(), f"the policy for {who!r}")  # the file's own rules
    if who in RESERVED_IDS:
        write_ring(path, ring.replace(**{who: checked}))
        return
    if ring.by_id(who) is None:
        raise KeysFileError(f"no key with id {who!r} in {path}")
    keys = tuple(dataclasses.replace(k, policy=checked) if k.id == who else k for k in ring.keys)
    write_ring(path, ring.replace(keys=keys))
