"""What ``python -m benchmarks.gpu --all`` runs: every step, in one command of a lent GPU.

A device command may run 10 minutes and a session has about 15 minutes of device time, the
machine's start included, so ``--all`` is sized to end inside 9 minutes with the install and import
check before it. Estimates come from the H200 runs of 2026-11-27 (exactness 69 s with pytest -m
cuda, engine 28 s, routing 23 s with 100,000 resident, invariance 53 s, profile 11 s), with room:
Triton compiles its kernels once per specialisation (about 1-3 s each) and a CUDA graph is captured
per shape and pool generation (two warm-up passes and the capture).

Order: exactness first (numbers that are wrong need no timing), then the figures the engine's goals
are judged by (fused and routed against their FLOP floors, the batch-invariant mode, the profile),
then memory, training and the server. Each step may spend what is left of the budget less the
reserves of the steps after it, so an overrun shortens the step that overran (it ends ``partial``),
not the ones after it. A reserve is what the step asks to have left before its first measurement
(its own check), so that a step that gets only its reserve still measures something.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEIT, B16 = "deit_tiny_patch16_224", "vit_base_patch16_224"
BOTH = (DEIT, B16)
BUDGET_S = 510.0  # the suite's; the install and import check before it take about 20 s


@dataclass(frozen=True)
class Part:
    step: str
    overrides: dict[str, Any] = field(default_factory=dict)  # on the GPU plan (plan.py)
    estimate_s: float = 0.0  # expected on an H100 or H200
    reserve_s: float = 0.0  # kept for it while the steps before it run: its first check's seconds


ALL: tuple[Part, ...] = (
    # Python, CUDA and cuBLAS start-up (~10 s); 2 shapes x 2 dtypes x (base, fused, routed, dense)
    # at batch 4 with Triton's first compiles (~25 s); the real DeiT-Tiny; ``pytest -m cuda`` (the
    # graph and kernel tests on the device; Triton compiles for the tests' shapes: 46 s of tests in
    # 57 s on 2026-11-27, past 60 s on 2026-11-28 with the kernels' own invariance test; the step 92 s
    # with pytest's 77 s at ba5e65b, before the engine loop's growth tests), cut at 120 s.
    Part("exactness", {"archs": BOTH, "dtypes": ("fp32", "bf16"), "pytest_s": 120.0}, 124, 30),
    # 2 shapes x bf16 x batch 64, 256: base vs timm, fused K = 8, 64, 1000 (m = 1), dense K = 64
    # (20 rows, 0.2-3 s each on the H200, a capture per shape and K: ~45 s with the engines and
    # 1,000 adapters per shape); tries at batch 64, ~19 s a shape: 4 SDPA backends, graphs on/off and
    # Triton/torch for fused K = 64 and routed 1 of 1,000, the rows' products joined/apart for fused
    # K = 8 and routed 8 of 1,000 (timed and profiled: ~4 s a shape, est.); the kernels' three tile
    # sets for fused K = 1,000 and routed 8 of 1,000 (eager, profiled: ~4 s a shape and ~5 s of
    # Triton compiles, est.). 33 s at ba5e65b without the tiles.
    Part(
        "engine",
        {
            "archs": BOTH,
            "large": (),
            "dtypes": ("bf16",),
            "batches": (64, 256),
            "ks": (8, 64, 1000),
            "ms": (1,),
            "tries_on": BOTH,
        },
        47,
        40,
    ),
    # 2 shapes x batch 64, 256, 1,000 resident, 1 and 8 tasks per image (2-4 s a row on the H200);
    # then ViT-B/16 with 100,000 resident (a bank's values on the device; prepared and installed in
    # ~20-30 s, est.).
    Part("routing", {"archs": BOTH, "dtypes": ("bf16",), "batches": (64, 256)}, 28, 20),
    # The op probe, then 2 shapes x bf16, fp32 at batch 64 (~24 s on the H200); the block sizes'
    # tries are decided (invariance.py ``tried``: none now).
    Part("invariance", {"archs": BOTH, "dtypes": ("bf16", "fp32"), "batches": (64,)}, 30, 30),
    # 2 shapes x 5 passes (the all-tasks K = 1,000 among them) x graphs on/off, 3 recorded passes
    # each, bf16 batch 64 and 256 (8 s for batch 64 on the H200).
    Part("profile", {"archs": BOTH, "dtypes": ("bf16",), "batches": (64, 256)}, 20, 15),
    # ViT-B/16 bf16 with 1,000, 10,000 and 100,000 resident: 10,000 random adapters made on the host
    # (~5 s), 100,000 from a bank on the device (~30 s, est.), each pass eager then graphed (the
    # unrouted one at 10,000 rows per image: ~0.3 s a pass; not run at 100,000).
    Part("memory", {"archs": (B16,), "dtypes": ("bf16",)}, 45, 45),
    # 2 shapes x batch 64, 256, fp32 (16 s on the H200 with the eager step). bfloat16, the profiled
    # step, the end-to-end regime and the trainer's CUDA tests are ``--steps training``'s (docs/gpu.md).
    Part(
        "training",
        {"archs": BOTH, "train_batches": (64, 256), "train_precisions": ("fp32",), "train_extras": False},
        25,
        30,
    ),
    # The real DeiT-Tiny in the default front end on a GPU host (8 API processes and one model
    # process, JPEGs decoded on the GPU): the bounds (~7 s), the group's start (~8 s for one process,
    # the group's not timed alone yet), each
    # photo alone, 6 s of full load with its drain and the load workers' start (~8 s), 6 s at half of
    # it, the two keys (3 s alone, 6 s beside the flood: ~13 s); then ViT-B/16 in bf16, its bounds,
    # start and full load (~28 s): 147 s in all on the H200 (2026-11-28). A model starts with
    # 3 x 6 + 60 s left. One process, the replicas and the CPU-decode variant are a second command's
    # (docs/gpu.md).
    Part("server", {"server_models": BOTH, "server_seconds": 6.0, "server_variants": 1}, 150, 80),
)
