"""What the serving path imports: nothing it does not use (training, plotting, Ray, the object-store
client for a local store), so ``memvit serve`` pays only for what serving needs (benchmarks.startup
measures it)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.launcher import REPO

NOT_FOR_SERVING = (
    "memvit.adapters.training",
    "matplotlib",
    "ray",
    "obstore",
    "memvit.server.store.object_store",
)


def test_the_app_on_a_local_store_imports_nothing_it_does_not_use(tmp_path) -> None:
    code = (
        "import json, sys\n"
        "from memvit.server.http.app import create_app\n"
        "from memvit.server.settings import Settings\n"
        "from memvit.server.store import open_store\n"
        f"open_store({str(tmp_path / 'store')!r})\n"
        "create_app(Settings(_env_file=None))\n"
        f"print(json.dumps([m for m in {NOT_FOR_SERVING!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
