"""Check, in seconds, that everything the GPU suite and the server import is there: the first thing
every device command runs (the prefix ``benchmarks.gpu.prepare`` prints), so that a missing wheel
costs seconds of a lease, not a skipped step found an hour later.

    python3 -m benchmarks.gpu.imports --cuda

Imports every module the suite's steps and ``memvit serve`` load, prints the versions that matter,
and, where ``.whl/manifest.json`` is there, holds the installed distributions to its pins and
memvit's wheel to this checkout's sources; it warns of any requirement of memvit's closure that
what is installed does not meet. Exits 1 naming whatever failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks.common import REPO

from . import wheels
from .closure import applies, closure, installed_requires, installed_version, is_gpu_stack

# The suite (its steps import the rest of memvit), the server step's own imports, and what
# ``memvit serve`` loads: the app and the libraries it starts with.
MODULES = (
    "torch",
    "triton",
    "torchvision",
    "torchvision.io",
    "torchvision.transforms.v2",
    "timm",
    "safetensors",
    "numpy",
    "PIL",
    "packaging",
    "httpx",
    "benchmarks.gpu.__main__",
    "benchmarks.loadgen",
    "benchmarks.load_procs",
    "tests.server.launcher",
    "memvit.memory_core",
    "memvit.adapters",
    "memvit.server.http.app",
    "memvit.server.cli",
    "memvit.server.inference.images",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "uvicorn",
    "httptools",
    "uvloop",
    "python_multipart",
    "obstore",
    "prometheus_client",
    "opentelemetry",
)
VERSIONS = (
    "torch", "triton", "torchvision", "timm", "safetensors", "numpy", "pillow", "fastapi", "starlette",
    "pydantic", "pydantic-core", "uvicorn", "obstore", "prometheus-client", "opentelemetry-api", "memvit",
)  # fmt: skip


def import_all(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Import each module; one line per failure."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or whatever a module raises while it loads
            failed.append(f"import {name}: {type(exc).__name__}: {exc}")
    return failed


def check_manifest(manifest: dict, repo: Path = REPO) -> list[str]:
    """The installed versions against the manifest's pins, and memvit's wheel against ``repo``."""
    failed = []
    for name, pinned in manifest["pins"].items():
        found = installed_version(name)
        if found != pinned:
            failed.append(
                f"{name}: {found or 'not installed'}, carried {pinned} (is /tmp/site first on PYTHONPATH?)"
            )
    if manifest["memvit_sources"] != wheels.source_digest(repo):
        failed.append(
            "memvit's wheel was built from other sources than this checkout: rerun benchmarks.gpu.prepare"
        )
    return failed


def check_requirements(version: Callable[[str], str | None] = installed_version) -> list[str]:
    """Every requirement in memvit's closure (this interpreter's markers) against what is installed,
    one line per requirement not met. Warnings, not failures: whatever imports may well run, and a
    lease is better spent measuring what does."""
    unmet = []
    found = closure("memvit", env=None)
    for requirer in sorted(found.followed | {"memvit"}):
        extras = found.reached[requirer].extras if requirer in found.reached else frozenset()
        for text in installed_requires(requirer) or []:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            if not applies(requirement, extras, None) or (is_gpu_stack(name) and name not in found.followed):
                continue  # not on this machine, or the image's own GPU stack (imported above)
            have = version(name)
            if have is None or not requirement.specifier.contains(have, prereleases=True):
                unmet.append(f"{requirer} needs {requirement}, found {have or 'nothing'}")
    return unmet


def versions() -> str:
    return ", ".join(f"{name} {installed_version(name) or '-'}" for name in VERSIONS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu.imports", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--cuda", action="store_true", help="fail unless torch sees a CUDA device")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="where the manifest is")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    failed = import_all()
    manifest = wheels.read_manifest(args.wheels)
    if manifest is not None:
        failed += check_manifest(manifest)
    warnings = check_requirements()
    import torch

    if args.cuda and not torch.cuda.is_available():
        failed.append("CUDA: torch sees no device")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"imports: {versions()}; Python {sys.version.split()[0]}; {device}")
    for line in warnings:
        print(f"imports: warning: {line}")
    for line in failed:
        print(f"imports: FAILED: {line}", file=sys.stderr)
    note = "" if manifest else f"; no manifest in {args.wheels}"
    print(
        f"imports: {'FAILED' if failed else 'ok'} in {time.perf_counter() - started:.1f} s{note}", flush=True
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
