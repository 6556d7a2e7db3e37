"""Crash-safe file writes, shared by bundles, checkpoints, the local adapter store and the keys file.

A file is written beside its target under a temp name, fsynced, then linked or renamed into place,
and the directory fsynced: after a crash at any point the target is absent, the old file, or the
whole new file, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def durable_temp(
    directory: Path, name: str, data: bytes, *, mode: int | None = None
) -> Iterator[tuple[Path, os.stat_result]]:
    """Yields a temp file in ``directory`` holding ``data``, fsynced, and its stat (taken from the
    open file, so it describes the bytes written even if another process renames over the target
    later). The caller links or renames it into place; whatever is left is removed on exit."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
            written = os.fstat(f.fileno())
        yield Path(tmp), written
    finally:
        Path(tmp).unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    """Makes the directory's entries (a rename, a link, an unlink) survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` so that ``path`` is either absent, the old file, or the whole new file.
    ``mode``: the file's permissions (e.g. 0o600 for secrets), set before it appears under its name."""
    path = Path(path)
    with durable_temp(path.parent, path.name, data, mode=mode) as (tmp, _):
        os.replace(tmp, path)
    fsync_dir(path.parent)
    return path
