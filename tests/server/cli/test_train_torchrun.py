"""``torchrun ... memvit train --sweep ...``: a sweep's variants split across processes
(adapters/training/distributed.py), here two CPU processes with gloo, as GPUs would be one each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memvit.adapters import read_bundle
from memvit.server.cli import app
from tests.conftest import REPO, max_diff
from tests.one_thread import one_torch_thread  # noqa: F401 (autouse, tests/one_thread.py)

runner = CliRunner()
SWEEP = ["--sweep", "lr=0.05,0.3", "--sweep", "memory-tokens=0,1"]


def _path() -> str:
    """The repository first, then whatever the path was (a GPU lease installs memvit elsewhere)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _args(tiny_weights, image_folder, out) -> list[str]:
    return [
        "train", "--name", "c", "--train-dir", str(image_folder), "--weights", str(tiny_weights),
        "--steps", "4", "--batch-size", "8", "--device", "cpu", "--quiet", "--out", str(out), *SWEEP,
    ]  # fmt: skip


def test_torchrun_splits_a_sweep_across_processes_and_changes_no_result(tmp_path, tiny_weights, image_folder):
    split, alone = tmp_path / "split", tmp_path / "alone"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _path()}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*launcher, "-m", "memvit.server.cli", *_args(tiny_weights, image_folder, split)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("<- chosen") == 1  # rank 0 reports, once
    assert {p.name for p in split.glob("*.ckpt")} == {"sweep.rank0-of-2.ckpt", "sweep.rank1-of-2.ckpt"}
    result = runner.invoke(app, _args(tiny_weights, image_folder, alone))
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in alone.glob("*.safetensors"))
    assert len(names) == 5 and names == sorted(p.name for p in split.glob("*.safetensors"))
    assert (split / "sweep.md").is_file()
    for name in names:  # each variant where it ends trained in one process with all the others
        a, b = read_bundle(split / name), read_bundle(alone / name)
        assert a.training["val_accuracy"] == b.training["val_accuracy"], name
        for key, tensor in b.tensors().items():
            assert not tensor.numel() or max_diff(a.tensors()[key], tensor) <= 2e-5, (name, key)


def test_torchrun_refuses_one_adapter_and_too_few_variants(tmp_path, tiny_weights, image_folder, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    args = _args(tiny_weights, image_folder, tmp_path / "out")
    result = runner.invoke(app, args[: -len(SWEEP)])
    assert result.exit_code == 2 and "one adapter trains in one process" in result.output
    result = runner.invoke(app, args)  # refused before joining a group that would wait for 7 others
    assert result.exit_code == 2 and "4 variant(s) on 8 processes" in result.output
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = runner.invoke(app, [*args, "--device", "cuda:1"])
    assert result.exit_code == 2 and "each process takes the GPU of its local rank" in result.output


@pytest.mark.cuda
@pytest.mark.skipif(
    not __import__("torch").cuda.device_count() >= 2, reason="needs two CUDA devices on this machine"
)
def test_torchrun_on_two_gpus(tmp_path, tiny_weights, image_folder) -> None:
    env = {**os.environ, "PYTHONPATH": _path()}
    args = [a if a != "cpu" else "cuda" for a in _args(tiny_weights, image_folder, tmp_path / "s")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, "-m", "memvit.server.cli", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    devices = {
        read_bundle(p).training["device"].split(" ")[0] for p in (tmp_path / "s").glob("c-*.safetensors")
    }
    assert devices == {"cuda:0", "cuda:1"}
