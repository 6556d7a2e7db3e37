"""Start-up: how long ``import memvit.server.cli`` takes, and ``memvit serve`` from launch to ``/readyz`` 200.

Runs a checkout (this one by default, or ``--repo DIR``: another checkout, to compare before and
after) in child processes: the import alone (wall time, and the top-level packages by self time
from ``python -X importtime``), and the server on the real DeiT-Tiny weights with an empty local
store. Medians of ``--rounds``.

    python -m benchmarks.startup
    python -m benchmarks.startup --repo . /tmp/memvit-before   # two checkouts, alternating
"""

from __future__ import annotations

import collections
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .common import DEIT_TINY, REPO, argument_parser

_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_seconds(repo: Path) -> tuple[float, dict[str, float]]:
    """Wall seconds of ``import memvit.server.cli`` in a fresh interpreter, and self seconds per package."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import memvit.server.cli"],
        cwd=repo, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    wall = time.perf_counter() - started
    per_package: collections.Counter[str] = collections.Counter()
    for line in done.stderr.splitlines():
        if m := _LINE.match(line):
            per_package[m.group(4).split(".")[0]] += int(m.group(1)) / 1e6
    return wall, dict(per_package.most_common(8))


def ready_seconds(repo: Path, store: Path) -> float:
    """``memvit serve`` (DeiT-Tiny, an empty local store) from launch to ``/readyz`` 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "MEMVIT_WEIGHTS": str(DEIT_TINY),
        "MEMVIT_ADAPTER_STORE": str(store),
        "MEMVIT_PORT": str(port),
        "MEMVIT_LOG_LEVEL": "warning",
    }
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memvit.server.cli", "serve"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"memvit serve in {repo} exited with {proc.returncode}")
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--repo", type=Path, nargs="+", default=[REPO], help="checkouts, alternated")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    imports: dict[Path, list[float]] = {repo: [] for repo in args.repo}
    ready: dict[Path, list[float]] = {repo: [] for repo in args.repo}
    packages: dict[Path, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="memvit-startup-") as tmp:
        for i in range(args.rounds):  # alternating: a busy minute of a shared machine hits each alike
            for j, repo in enumerate(args.repo):
                wall, packages[repo] = import_seconds(repo)
                imports[repo].append(wall)
                ready[repo].append(ready_seconds(repo, Path(tmp) / f"store{i}-{j}"))
    for repo in args.repo:
        print(f"checkout: {repo}")
        rounds = ", ".join(f"{x:.2f}" for x in imports[repo])
        print(f"  import memvit.server.cli: median {statistics.median(imports[repo]):.2f} s ({rounds})")
        top = ", ".join(f"{k} {v:.2f} s" for k, v in packages[repo].items())
        print(f"  self time by package (last round): {top}")
        rounds = ", ".join(f"{x:.2f}" for x in ready[repo])
        median = statistics.median(ready[repo])
        print(f"  memvit serve to /readyz 200 (DeiT-Tiny, empty store): median {median:.2f} s ({rounds})")


if __name__ == "__main__":
    main()
