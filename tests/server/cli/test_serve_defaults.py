"""``memvit serve``'s front end by host: one process on a CPU; on a GPU host, unless
MEMVIT_API_PROCESSES is set, API processes before one model process (server/cli/serve.py)."""

from __future__ import annotations

import pytest

from memvit.server.cli import gpu_host_default
from memvit.server.settings import Settings


def never() -> bool:
    raise AssertionError("the device was asked for where the settings already say")


@pytest.mark.parametrize("cores,expected", [(16, 8), (64, 8), (8, 4), (2, 2), (1, 2)])
def test_a_gpu_host_serves_with_api_processes_before_one_model_process(cores, expected) -> None:
    chosen = gpu_host_default(Settings(_env_file=None), cuda=lambda: True, cores=cores)
    assert chosen.api_processes == expected
    assert chosen.front_end_mode == "model-process"


def test_a_cpu_host_serves_in_one_process() -> None:
    assert gpu_host_default(Settings(_env_file=None), cuda=lambda: False, cores=16).front_end_mode == "single"
    assert gpu_host_default(Settings(_env_file=None, device="cpu"), cuda=never).api_processes == 1


def test_a_gpu_named_needs_no_asking_and_a_set_count_is_kept(monkeypatch) -> None:
    assert gpu_host_default(Settings(_env_file=None, device="cuda"), cuda=never, cores=16).api_processes == 8
    assert gpu_host_default(Settings(_env_file=None, api_processes=1), cuda=never).api_processes == 1
    monkeypatch.setenv("MEMVIT_API_PROCESSES", "1")  # as an operator sets it
    assert gpu_host_default(Settings(_env_file=None), cuda=lambda: True, cores=16).front_end_mode == "single"
    monkeypatch.setenv("MEMVIT_API_PROCESSES", "3")
    monkeypatch.setenv("MEMVIT_FRONT_END", "replicas")
    chosen = gpu_host_default(Settings(_env_file=None), cuda=lambda: True, cores=16)
    assert (chosen.api_processes, chosen.front_end_mode) == (3, "replicas")


def test_the_check_itself_runs_here() -> None:
    """On this machine (no GPU in CI): the real check answers, and a CPU host stays one process."""
    import torch

    chosen = gpu_host_default(Settings(_env_file=None))
    assert chosen.front_end_mode == ("model-process" if torch.cuda.is_available() else "single")


@pytest.mark.parametrize(
    "files,expected",
    [
        ({"cpu.max": "400000 100000\n"}, 4),  # a pod limited to 4 CPUs
        ({"cpu.max": "max 100000\n"}, None),  # no quota: the affinity's
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_the_cores_counted_are_the_containers(tmp_path, files, expected) -> None:
    import os

    from memvit.server.cli.serve import usable_cores

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == (affinity if expected is None else min(expected, affinity))
