"""Threads named for the operating system (server/telemetry/os_names.py): the engine's and the link's
threads show their names in /proc, where the GPU suite reads each one's CPU time."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.processes import thread_seconds
from memvit.memory_core import LiveAdapters
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.engine_loop import EngineLoop
from memvit.server.telemetry.metrics import Metrics
from memvit.server.telemetry.os_names import os_named

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc: Linux")


def _names() -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path("/proc/self/task").glob("[0-9]*")}


def _spinner(stop: threading.Event):
    """A thread's body: 0.2 s of CPU, then idle until ``stop``."""

    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        stop.wait(10)

    return spin


def _until_counted(name: str, seconds: float = 0.15) -> None:
    """Until ``thread_seconds`` gives ``name`` at least ``seconds`` of CPU (5 s at most)."""
    deadline = time.monotonic() + 5
    while thread_seconds(os.getpid()).get(name, 0.0) < seconds:
        assert time.monotonic() < deadline, thread_seconds(os.getpid())
        time.sleep(0.02)


def test_a_named_thread_is_named_and_counted_by_name() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=os_named("memvit-spinner-long", _spinner(stop)), daemon=True)
    thread.start()
    try:
        _until_counted("memvit-spinner-")
        assert "memvit-spinner-" in _names()  # the kernel keeps 15 bytes
    finally:
        stop.set()
        thread.join()


def test_the_engine_loops_threads_carry_their_names(engine) -> None:
    loop = EngineLoop(LiveAdapters(engine), DeviceRunner(engine, lanes=2), max_batch=4, max_wait=0,
                      max_queue=8, metrics=Metrics(), depth=3)  # fmt: skip
    loop.start()
    try:
        deadline = time.monotonic() + 5
        want = {"engine-batcher", "engine-batcher1", "engine-pass", "engine-collect"}
        while not want <= _names():
            assert time.monotonic() < deadline, _names()
            time.sleep(0.01)
    finally:
        loop.stop()


def test_threads_that_inherit_a_name_count_apart_from_the_first() -> None:
    """torch's pool workers take the name of the thread that first forked it: counted as ``name+``."""
    stop = threading.Event()

    def parent() -> None:  # named, then starts a child that inherits the name and spins
        child = threading.Thread(target=_spinner(stop), daemon=True)
        child.start()
        stop.wait(10)
        child.join()

    thread = threading.Thread(target=os_named("memvit-parent", parent), daemon=True)
    thread.start()
    try:
        _until_counted("memvit-parent+")
        assert thread_seconds(os.getpid())["memvit-parent"] < 0.1  # the parent itself only waits
    finally:
        stop.set()
        thread.join()
