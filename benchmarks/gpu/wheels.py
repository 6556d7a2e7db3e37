"""The wheel folder a lent GPU machine installs from: the selected wheels (closure.py) for the device's
Python, memvit's own built from this checkout, and a manifest the device checks them against.

The manifest (``manifest.json`` beside the wheels) pins each carried distribution to this
environment's version and fingerprints memvit's sources: the device runs memvit from the wheel, so a
wheel built before the last edit would measure old code; ``benchmarks.gpu.imports`` refuses it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name, parse_wheel_filename

from benchmarks.common import REPO

MANIFEST = "manifest.json"
# The repository folders that install as memvit.* (pyproject.toml's package-dir).
MEMVIT_SOURCES = ("memory_core", "adapters", "server")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]


def source_digest(repo: Path = REPO) -> str:
    """SHA-256 of memvit's Python sources in ``repo`` (path and content of each), as built into its
    wheel: the same here and on the device, whose checkout is a copy of this one."""
    digest = hashlib.sha256()
    for folder in MEMVIT_SOURCES:
        for path in sorted((repo / folder).rglob("*.py")):
            digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def download(target: Path, pins: dict[str, str]) -> None:
    """Wheels of ``pins`` (name -> version) for CPython 3.12 on x86-64 Linux, without dependencies
    (the selection already holds every one that is needed)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target)]
    subprocess.run([*command, *(f"{name}=={version}" for name, version in sorted(pins.items()))], check=True)


def prune(target: Path, pins: dict[str, str]) -> list[str]:
    """Remove every wheel of ``target`` that is not one of ``pins`` (nor memvit's): two versions of
    a distribution stop the whole install on the device. Returns the removed files' names."""
    removed = []
    for path in sorted(target.glob("*.whl")):
        name, version, *_ = parse_wheel_filename(path.name)
        if name == "memvit" or pins.get(name) == str(version):
            continue
        path.unlink()
        removed.append(path.name)
    return removed


def build_memvit(target: Path) -> Path:
    """memvit's wheel from this checkout (replacing any older one)."""
    for old in target.glob("memvit-*.whl"):
        old.unlink()
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(target), str(REPO)]
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL)
    (built,) = target.glob("memvit-*.whl")
    return built


def write_manifest(target: Path, pins: dict[str, str], image_read: str) -> dict[str, Any]:
    manifest = {
        "pins": dict(sorted(pins.items())),
        "memvit_sources": source_digest(),
        "commit": _commit(),  # the suite's reports name it (a device's copy may have no history)
        "image_read": image_read,
    }
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(target: Path) -> dict[str, Any] | None:
    path = target / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def canonical_pins(pins: dict[str, str]) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in pins.items()}


def _commit() -> str | None:
    """This checkout's HEAD, with ``+`` when tracked sources differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    return (head + ("+" if dirty else "")) or None
