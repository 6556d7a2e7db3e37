"""The adapter store: a directory of ``<name>.safetensors`` bundles, the source of truth.

Writes are crash-safe: a bundle is written to a temp file, fsynced, then linked (new name) or renamed
(replace) into place and the directory fsynced, so after a crash at any point a name holds either
nothing, the old bundle or the whole new one. Linking fails if the name exists, which makes "create"
atomic across replicas sharing the directory. File names come from validated adapter names only; a
client-supplied path is never opened.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from adapters import AdapterBundle, write_atomic
from memory_core import DuplicateAdapterError, UnknownAdapterError, check_name

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
SEEDED_MARKER = ".seeded"  # hidden: scan() never lists it


@dataclass(frozen=True)
class FileState:
    """What tells a changed file from an unchanged one without reading it."""

    size: int
    mtime_ns: int
    inode: int


class AdapterStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"adapter store {self.root} is not writable")

    def path(self, name: str) -> Path:
        check_name(name)  # raises for anything that is not a plain adapter name
        return self.root / f"{name}{SUFFIX}"

    def scan(self) -> dict[str, FileState]:
        """Bundle files by adapter name (from the file name); temp and hidden files are skipped."""
        found = {}
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(SUFFIX) or not entry.is_file():
                    continue
                stat = entry.stat()
                found[entry.name[: -len(SUFFIX)]] = FileState(stat.st_size, stat.st_mtime_ns, stat.st_ino)
        return found

    def write(self, bundle: AdapterBundle, *, replace: bool) -> FileState:
        """Persist ``bundle`` under its name. Without ``replace``, an existing name is a conflict."""
        target = self.path(bundle.name)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{bundle.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(bundle.to_bytes())
                f.flush()
                os.fsync(f.fileno())
                # The state of the file *we* wrote (a rename or link keeps inode, size and mtime). Reading
                # the target after the rename instead could record another replica's replace that
                # landed in between as already seen, and this replica would serve its own bytes for good.
                written = os.fstat(f.fileno())
            if replace:
                os.replace(tmp, target)
            else:
                try:
                    os.link(tmp, target)  # atomic create-if-absent, also across replicas
                except FileExistsError:
                    raise DuplicateAdapterError(
                        f"an adapter named {bundle.name!r} is already in the store; ask to replace it",
                        field="name",
                    ) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._sync_dir()
        return FileState(written.st_size, written.st_mtime_ns, written.st_ino)

    def seed_once(self, bundles: dict[str, Path]) -> bool:
        """Give a brand-new store its first bundles, once in its life. Returns True if it seeded.

        Seeds only when the store has never been seeded and holds no bundle. The marker is written
        (atomically) before the bundles, so an acknowledged deletion can never be undone by a later
        restart or by another replica starting on the same, now empty, store; a crash half-way
        leaves some seed bundles missing rather than deleted ones back. Existing stores that were
        never marked get the marker on first sight, without seeding.
        """
        marker = self.root / SEEDED_MARKER
        if marker.exists():
            return False
        empty = not self.scan()
        write_atomic(marker, b"seeded\n" if empty else b"had bundles before seeding was tracked\n")
        if not empty:
            return False
        for name, source in bundles.items():
            target = self.path(name)
            if not target.exists():
                write_atomic(target, source.read_bytes())
        return True

    def delete(self, name: str) -> None:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            raise UnknownAdapterError(f"no adapter named {name!r} in the store", field="name") from None
        self._sync_dir()

    def clean_temp_files(self, older_than: float = 3600.0) -> int:
        """Remove temp files left by writers that died; young ones may belong to a live replica."""
        removed = 0
        now = time.time()
        for path in self.root.glob(".*.tmp"):
            try:
                if now - path.stat().st_mtime > older_than:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        if removed:
            log.warning("removed %d stale temp file(s) from %s", removed, self.root)
        return removed

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
