"""The adapter store in a local (or shared, POSIX) directory: one file per key, ``/`` a subdirectory.

Writes are crash-safe: bytes go to a temp file beside the target, are fsynced, then linked (create)
or renamed (overwrite) into place and the directory fsynced, so after a crash at any point a key
holds nothing, the old bytes or the whole new ones. Linking fails if the name exists, which makes
create-if-absent atomic across replicas sharing the directory; replace-if-unchanged holds an
``flock`` on the store's lock file around its check and rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from memvit.adapters.files import durable_temp, fsync_dir

from .base import AdapterStore, ObjectChangedError, ObjectExistsError, ObjectTooLargeError, ObjectVersion

log = logging.getLogger(__name__)
LOCK_FILE = ".lock"


def _version(stat: os.stat_result) -> ObjectVersion:
    return ObjectVersion(f"{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}", stat.st_size)


class LocalStore(AdapterStore):
    read_parallelism = min(4, os.cpu_count() or 1)  # parsing is CPU work: more threads only contend

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"adapter store {self.root} is not writable")
        self.location = str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    # -- primitives --------------------------------------------------------------------------------
    def _list(self, prefix: str = "") -> dict[str, ObjectVersion]:
        found = {}
        # Walk only the folder the prefix names (keys' "/" are folders), not 100,000 adapters' ones.
        top = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        for directory, _, files in os.walk(top):
            folder = os.path.relpath(directory, self.root)
            for name in files:
                if name.endswith(".tmp") or (name == LOCK_FILE and folder == "."):
                    continue
                key = name if folder == "." else f"{folder}/{name}".replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    found[key] = _version(os.stat(os.path.join(directory, name)))
                except FileNotFoundError:  # deleted while we looked
                    continue
        return found

    def _get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, ObjectVersion]:
        with open(self.path(key), "rb") as f:
            # The version of the file we opened: a rename by another replica after this point
            # does not change what we read, and the next scan sees the new version.
            version = _version(os.fstat(f.fileno()))
            if max_bytes is not None and version.size > max_bytes:
                raise ObjectTooLargeError(f"{key} is {version.size} bytes, over the {max_bytes}-byte limit")
            return f.read(), version

    def _put(self, key: str, data: bytes, *, mode: str | ObjectVersion) -> ObjectVersion:
        target = self.path(key)
        self._make_parents(target.parent)
        # The temp file beside its target: a link or rename never crosses directories.
        with durable_temp(target.parent, target.name, data) as (tmp, stat):
            # The state of the file *we* wrote (a rename or link keeps inode, size and mtime).
            # Reading the target after the rename instead could record another replica's
            # replace that landed in between as already seen.
            written = _version(stat)
            if mode == "create":
                try:
                    os.link(tmp, target)  # atomic create-if-absent, also across replicas
                except FileExistsError:
                    raise ObjectExistsError(key) from None
            elif mode == "overwrite":
                os.replace(tmp, target)
            else:
                with self._locked():
                    try:
                        current = _version(os.stat(target))
                    except FileNotFoundError:
                        current = None
                    if current != mode:
                        raise ObjectChangedError(key)
                    os.replace(tmp, target)
        fsync_dir(target.parent)
        return written

    def _delete(self, key: str) -> None:
        path = self.path(key)
        path.unlink()
        fsync_dir(path.parent)

    def _make_parents(self, directory: Path) -> None:
        """Create ``directory`` (under the root) durably: each new level's parent is fsynced, so a
        file linked into it after a crash is not lost with a directory entry that never reached disk."""
        if directory.is_dir():
            return
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for level in reversed(missing):
            level.mkdir(exist_ok=True)  # another writer may create it at the same moment
            fsync_dir(level.parent)

    # -- housekeeping ------------------------------------------------------------------------------
    def clean_temp_files(self, older_than: float = 3600.0) -> int:
        """Remove temp files left by writers that died; young ones may belong to a live replica."""
        removed = 0
        now = time.time()
        for path in self.root.rglob(".*.tmp"):  # beside their targets, in subdirectories too
            try:
                if now - path.stat().st_mtime > older_than:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        if removed:
            log.warning("removed %d stale temp file(s) from %s", removed, self.root)
        return removed

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock
