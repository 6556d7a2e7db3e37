"""Several GPUs of one host: a sweep's variants split across the processes ``torchrun`` starts.

    torchrun --standalone --nproc-per-node gpu --no-python \\
        memvit train --name pets --train-dir data/pets --sweep lr=0.01,0.05 --sweep memory-tokens=0,1,5

Each process (rank) takes every ``world``-th variant of the sweep, starting at its rank, and trains
them in ONE run on its own device (``cuda:LOCAL_RANK``; the CPU when there is none, where the same
launcher runs the same code with the gloo backend, as the tests do). The variants are independent
(docs/design.md §2.8), so the processes never exchange gradients: each decodes the data and runs the
base for its own share, and an 8-variant sweep on 8 GPUs takes about the time of one variant on one.
Rank 0 builds the activation cache first and the others open it once it is whole; each rank keeps
its own checkpoint (``NAME.rankR-of-W.ckpt``, resumable with the same number of processes); the
results are gathered so that every rank holds all of them, and rank 0 writes the chosen bundle and
the report (sweep.py).

Why processes and not one process driving every GPU: each device then has its own Python thread of
launches, its own data workers and its own CUDA graphs, and a variant's run is the one-device run
exactly; torchrun (PyTorch's own launcher) is what Hugging Face ``accelerate``, Lightning and timm
use for the same reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from memvit.memory_core import MemoryViT

from .config import TrainConfig, TrainingError
from .results import TrainResult
from .run import TrainingRun


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ones torchrun started."""

    rank: int
    world: int
    local: int

    @classmethod
    def from_env(cls) -> Ranks | None:
        """From torchrun's variables; None when this process runs alone."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))

    def device(self, setting: str) -> str:
        """The device this rank trains on: its own GPU (``cuda:LOCAL_RANK``), or the CPU."""
        if setting.startswith("cuda:"):
            raise TrainingError(
                f"--device {setting} under torchrun: each process takes the GPU of its local rank; "
                "give --device cuda (or auto), and CUDA_VISIBLE_DEVICES to choose the GPUs"
            )
        if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
            return "cpu"
        return f"cuda:{self.local}"

    def checkpoint(self, path: Path) -> Path:
        return path.with_name(f"{path.stem}.rank{self.rank}-of-{self.world}{path.suffix}")


def start(ranks: Ranks, setting: str, variants: int) -> None:
    """Join the process group (NCCL between GPUs, gloo between CPU processes) to train ``variants``;
    refused, by every rank alike and before any waits for another, when some rank would have none."""
    if variants < ranks.world:
        raise TrainingError(
            f"{variants} variant(s) on {ranks.world} processes: each process trains at least one; "
            f"start at most {variants} (--nproc-per-node)"
        )
    device = ranks.device(setting)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def train_across(
    engine: MemoryViT,
    configs: Sequence[TrainConfig],
    ranks: Ranks,
    *,
    outs: Sequence[str | Path] | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    resume: bool = False,
    progress: bool = True,
    curve_points: int = 0,
    rebuild_cache: bool = False,
) -> list[TrainResult]:
    """Every config's result, in order, on every rank; this rank trains ``configs[rank::world]`` (its
    bundles written to the matching ``outs``)."""
    start(ranks, configs[0].device, len(configs))
    mine = list(range(ranks.rank, len(configs), ranks.world))
    device = ranks.device(configs[0].device)
    local = [dataclasses.replace(configs[i], device=device) for i in mine]
    kw = {
        "checkpoint": None if checkpoint is None else ranks.checkpoint(Path(checkpoint)),
        "checkpoint_every": checkpoint_every,
        "curve_points": curve_points,
        "progress": progress and ranks.rank == 0,  # one bar: rank 0's
    }
    if ranks.rank == 0:  # builds the caches (if any) while the others wait, then they open them
        run = TrainingRun(engine, local, rebuild_cache=rebuild_cache, **kw)
        dist.barrier()
    else:
        dist.barrier()
        run = TrainingRun(engine, local, **kw)
    if resume:
        run.resume()
    run.run()
    results = run.finish(None if outs is None else [outs[i] for i in mine])
    gathered: list[list[tuple[int, TrainResult]] | None] = [None] * ranks.world
    dist.all_gather_object(gathered, list(zip(mine, results, strict=True)))
    everything = sorted((pair for part in gathered for pair in part or ()), key=lambda pair: pair[0])
    return [result for _, result in everything]
