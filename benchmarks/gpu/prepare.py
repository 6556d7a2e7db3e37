"""Lay out what a lent GPU machine needs beyond the repository (it receives the repository alone).

    python -m benchmarks.gpu.prepare            # before asking for the machine (docs/gpu.md)

- ``gpu-data/``: the shared data the suite reads, in the layout of ``../shared/data`` (the real
  DeiT-Tiny, the natural photos, the ImageNet labels; about 26 MB);
- ``.whl/``: wheels, for the device image's Python 3.12, of the packages its image lacks or may hold
  at another version: the server's (FastAPI, pydantic, uvicorn, obstore...) and timm, pinned to the
  versions of this environment, so the GPU figures come from the same timm as the CPU ones; and
  memvit's own, built from this checkout (the suite imports ``memvit.*``, which only an install
  provides: the folders install under that name).

Both folders are ignored by git; name them in the run's ``carry``. Prints the command prefix that
installs the wheels and points the suite at the data.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO, SHARED_DATA

DATA = ("deit_tiny", "photos/natural", "imagenet_labels")
WHEELS = (
    "timm",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "python-multipart",
    "uvicorn",
    "httptools",
    "obstore",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "anyio",
)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
PREFIX = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD MEMVIT_SHARED_DATA=$PWD/gpu-data "
    "PYTHONUNBUFFERED=1 || exit;"
)


def copy_data(target: Path) -> None:
    for part in DATA:
        source = SHARED_DATA / part
        if not source.exists():
            print(f"  {source} is missing: the steps that need it will say so", file=sys.stderr)
            continue
        shutil.copytree(source, target / part, dirs_exist_ok=True)


def download_wheels(target: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), *pins]
    subprocess.run(command, check=True)
    for old in target.glob("memvit-*.whl"):
        old.unlink()  # one memvit wheel, this checkout's
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(target), str(REPO)], check=True
    )


def main() -> None:
    copy_data(REPO / "gpu-data")
    download_wheels(REPO / ".whl")
    size = sum(p.stat().st_size for d in ("gpu-data", ".whl") for p in (REPO / d).rglob("*") if p.is_file())
    print(f"gpu-data/ and .whl/ ready ({size / 2**20:.0f} MiB; the working tree may carry 64 MiB in all)")
    print(f'carry: ["gpu-data", ".whl"]\ncommand prefix: {PREFIX}')


if __name__ == "__main__":
    main()
