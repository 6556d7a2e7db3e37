"""Lay out what a lent GPU machine needs beyond the repository (it receives the repository alone).

    python -m benchmarks.gpu.prepare            # before asking for the machine (docs/gpu.md)
    python -m benchmarks.gpu.prepare --dry-run  # what it would carry, and why

- ``gpu-data/``: the shared data the suite reads, in the layout of ``../shared/data`` (the real
  DeiT-Tiny, the natural photos, the ImageNet labels, the CIFAR-10 test tarball; about 30 MB);
- ``.whl/``: wheels for the device image's Python 3.12: memvit's installed requirement closure as
  the device needs it (closure.py: markers evaluated for CPython 3.12 on x86-64 Linux, no extras),
  pinned to this environment's versions, less the GPU stack and what the device image holds; timm
  always (the GPU figures must come from the timm the CPU ones did); memvit's own wheel built from
  this checkout (the suite imports ``memvit.*``, which only an install provides); and a manifest
  that the device's import check holds them to (wheels.py).

Both folders are ignored by git; name them in the run's ``carry``. Prints the command prefix that
installs the wheels, checks every import and points the suite at the data.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from benchmarks.common import REPO, SHARED_DATA

from . import wheels
from .closure import IMAGE_READ, Selection, installed_version, select

# The CIFAR-10 test tarball (3.3 MB) is the training step's end-to-end regime (train_regime.py).
DATA = ("deit_tiny", "photos/natural", "imagenet_labels", "cifar10/cifar10_jpg_test_10k.tar.gz")
PREFIX = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD MEMVIT_SHARED_DATA=$PWD/gpu-data "
    "PYTHONUNBUFFERED=1 && python3 -m benchmarks.gpu.imports --cuda || exit;"
)
# The whole suite in one device command (docs/gpu.md), its log beside the reports in $OUT.
COMMAND = PREFIX + " set -o pipefail; python3 -m benchmarks.gpu --all 2>&1 | tee $OUT/suite.log"
LIMIT_MIB = 64  # what a device call may carry, the working tree included


def copy_data(target: Path) -> None:
    for part in DATA:
        source = SHARED_DATA / part
        if not source.exists():
            print(f"  {source} is missing: the steps that need it will say so", file=sys.stderr)
            continue
        if source.is_dir():
            shutil.copytree(source, target / part, dirs_exist_ok=True)
        else:
            (target / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / part)


def pins_of(selection: Selection) -> dict[str, str]:
    """Each carried distribution at this environment's version; refuses one not installed here (the
    closure cannot see its own requirements, so the selection would be incomplete)."""
    if selection.closure.missing:
        raise SystemExit(
            f"needed on the device but not installed here: {sorted(selection.closure.missing)}; "
            "install memvit's runtime dependencies in this environment (pip install -e .) and rerun"
        )
    return {name: installed_version(name) or "" for name in selection.carry}


def describe(selection: Selection, pins: dict[str, str]) -> str:
    reached = selection.closure.reached
    lines = [f"carried ({len(pins)} + memvit):"]
    for name, version in pins.items():
        why = " (newer than the image may hold)" if name in selection.newer_than_image else ""
        lines.append(f"  {name}=={version}  <- {reached[name].via}{why}")
    lines.append(
        f"left to the device image (KINDS.md, read {IMAGE_READ}): " + ", ".join(sorted(selection.from_image))
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.prepare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dry-run", action="store_true", help="print the selection; download nothing")
    args = parser.parse_args(argv)
    selection = select()
    pins = pins_of(selection)
    print(describe(selection, pins))
    if args.dry_run:
        return
    target = REPO / ".whl"
    target.mkdir(exist_ok=True)
    copy_data(REPO / "gpu-data")
    wheels.download(target, pins)
    for name in wheels.prune(target, pins):
        print(f"  removed {name} (not in the selection)")
    built = wheels.build_memvit(target)
    wheels.write_manifest(target, pins, IMAGE_READ)
    size = sum(p.stat().st_size for d in ("gpu-data", ".whl") for p in (REPO / d).rglob("*") if p.is_file())
    print(f"{built.name}; gpu-data/ and .whl/ ready ({size / 2**20:.0f} MiB; a call carries {LIMIT_MIB} MiB)")
    print(
        f'carry: ["gpu-data", ".whl"]\ncommand prefix: {PREFIX}\nthe whole suite (timeout_s 600): {COMMAND}'
    )


if __name__ == "__main__":
    main()
