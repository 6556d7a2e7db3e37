"""benchmarks/gc_pauses.py: its ``sitecustomize`` times a process's full collections (and, for "not
frozen", makes ``gc.freeze`` do nothing); the log's lines are read back per process and window."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.gc_pauses import full_collections, site_dir

PROBE = "import gc; gc.freeze(); print(gc.get_freeze_count() > 0, flush=True); gc.collect(); gc.collect(0)"


def _probe(tmp_path, frozen: bool) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(site_dir(tmp_path, frozen))}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def test_every_full_collection_of_a_process_is_timed(tmp_path) -> None:
    since = time.time()
    froze, log = _probe(tmp_path / "a", frozen=True)
    assert froze == "True"
    pauses = full_collections(log, since, time.time())
    ((who, ms),) = pauses.items()  # one process: the probe
    assert who.endswith(")") and len(ms) >= 1 and all(m >= 0 for m in ms)  # generation 0: not listed
    assert full_collections(log, time.time() + 1, time.time() + 2) == {}  # outside the window


def test_not_frozen_leaves_gc_freeze_a_no_op(tmp_path) -> None:
    froze, _ = _probe(tmp_path / "b", frozen=False)
    assert froze == "False"
