"""What the batch-invariant mode costs, and whether it holds: img/s invariant vs default, same weights.

    python -m benchmarks.batch_invariance                  # DeiT-Tiny and ViT-B/32, batch 16 and 32
    python -m benchmarks.batch_invariance --archs deit_tiny_patch16_224 --batches 16 --rounds 3
    python -m benchmarks.batch_invariance --ops            # which ops change with the batch, op by op

Random weights (the cost does not depend on them). For each base and batch size, in interleaved
rounds: the base alone, 8 adapters for every image (m=1, 100 classes) and a routed batch (64 loaded,
one random task per image), each in the default and in the invariant mode (``MemoryViT(...,
batch_invariant=True)``, memory_core/invariant/mode.py). Each ratio is the median of per-round ratios
invariant / default of img/s. Every row also checks the mode's promise on that batch: image 0's
logits alone equal its logits in the batch, bitwise (``invariant``), and says whether the default mode
happened to give equal ones (``default``).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import argument_parser, environment, interleaved, pin_malloc
from memvit.memory_core import FusedOutput, MemoryViT
from tests.factories import random_adapter


def _pair(arch: str, device: str, dtype: torch.dtype, **kwargs: Any) -> tuple[MemoryViT, MemoryViT]:
    default = MemoryViT.from_timm(arch, device=device, dtype=dtype, **kwargs)
    invariant = MemoryViT.from_timm(arch, device=device, dtype=dtype, batch_invariant=True, **kwargs)
    invariant.base.load_state_dict(default.base.state_dict())
    return default, invariant


def _same_alone(engine: MemoryViT, run: Callable[[torch.Tensor], FusedOutput], x: torch.Tensor) -> bool:
    """Image 0's logits alone == in the batch ``x`` (every task it gets), bitwise."""
    alone, batch = run(x[:1]), run(x)
    if not torch.equal(alone.base[0], batch.base[0]):
        return False
    for name, rows in alone.adapters.items():
        where = (batch.images[name] == 0).nonzero()
        if len(where) and not torch.equal(rows[0], batch.adapters[name][where[0, 0]]):
            return False
    return True


def bench(
    arch: str,
    batch: int,
    rounds: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    timing: Callable[[dict, int], dict[str, list[float]]] = interleaved,
    **kwargs: Any,
) -> list[dict]:
    """Rows of the table below for one base and batch; ``timing`` times a dict of calls in rounds
    (the GPU suite's syncs the device); ``kwargs`` go to timm (the suite's tiny shapes)."""
    default, invariant = _pair(arch, device, dtype, **kwargs)
    x = torch.randn(batch, 3, *default.spec.img_size).to(device, dtype)
    adapters = [random_adapter(f"t{i:02d}", default, m=1, classes=100, memory_std=0.02) for i in range(64)]
    sets = {e: (e.prepare_set(adapters[:8]), e.prepare_set(adapters)) for e in (default, invariant)}
    rng = random.Random(batch)
    tasks = [[rng.choice(adapters).name] for _ in range(batch)]
    tasks[0] = [adapters[0].name]  # image 0 asks for a task in every routed pass, alone too
    modes: dict[str, Callable[[MemoryViT], Callable[[torch.Tensor], FusedOutput]]] = {
        "base only": lambda e: lambda images: e(images),
        "8 adapters, all": lambda e: lambda images: e(images, sets[e][0]),
        "routed, 1 of 64": lambda e: lambda images: e(images, sets[e][1], tasks=tasks[: len(images)]),
    }
    engines = (default, invariant)
    runs = {f"{mode}/{e.batch_invariant}": make(e) for mode, make in modes.items() for e in engines}
    times = timing({key: (lambda run=run: run(x)) for key, run in runs.items()}, rounds)
    rows = []
    for mode, make in modes.items():
        d, i = times[f"{mode}/False"], times[f"{mode}/True"]
        rows.append(
            {
                "arch": arch,
                "batch": batch,
                "mode": mode,
                "default_img_s": batch / statistics.median(d),
                "invariant_img_s": batch / statistics.median(i),
                "ratio": statistics.median(td / ti for td, ti in zip(d, i, strict=True)),
                "invariant_holds": _same_alone(invariant, make(invariant), x),
                "default_holds": _same_alone(default, make(default), x),
            }
        )
    return rows


def op_probe(device: str = "cpu") -> list[tuple[str, bool]]:
    """Op by op, at DeiT-Tiny's shapes: is image 0's (or row 0's) result alone == in a batch of 2..32?"""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    D, H, T, d = 192, 3, 197, 64
    conv = torch.nn.Conv2d(3, D, 16, 16).to(device)
    w, b, head = randn(4 * D, D), randn(4 * D), randn(1000, D)
    ln = torch.nn.LayerNorm(D).to(device)
    images, rows = randn(32, 3, 224, 224), randn(32 * T, D)
    q, k, v = randn(32, H, T, d), randn(32, H, T, d), randn(32, H, T, d)
    scores, pad = randn(4, H, 8, T + 6), torch.full((4, H, 8, 10), float("-inf"), device=device)
    probs = F.pad(scores.softmax(-1)[..., :6], (0, 32))  # six memory weights, then zero padding

    def memory_scores(n: int) -> torch.Tensor:
        return torch.einsum("bhkd,khpd->bhkp", q[:n, :, :1], k[:1, :, :5])[0]

    probes: dict[str, Callable[[int], torch.Tensor]] = {
        "patch embedding conv, B images": lambda n: conv(images[:n])[0],
        "linear on B*T token rows": lambda n: F.linear(rows[: n * T], w, b)[:T],
        "layer norm on B*T rows": lambda n: ln(rows[: n * T])[:T],
        "SDPA per (image, head)": lambda n: F.scaled_dot_product_attention(q[:n], k[:n], v[:n])[0],
        "head linear on B rows": lambda n: F.linear(rows[:n], head)[0],
        "class-token scores, K rows per image": lambda n: (q[:1, :, :n] @ k[:1].transpose(-2, -1))[0, :, 0],
        "memory scores einsum, B images": memory_scores,
        "memory scores einsum, P keys wide": lambda n: torch.einsum(
            "bhkd,khpd->bhkp", q[:4, :, :2], k[:2, :, : n + 1]
        )[..., :1],
        "memory values einsum, P padded": lambda n: torch.einsum(
            "bhkp,khpd->bhkd", probs[..., : 5 + n], v[:1, :, : 5 + n].expand(8, -1, -1, -1)
        ),
        "memory projection, m rows together": lambda n: F.linear(rows[:n], w, b)[0],
        "softmax, -inf padding": lambda n: torch.cat([scores, pad[..., :n]], -1).softmax(-1)[..., : T + 6],
    }
    results = []
    for name, fn in probes.items():
        ref = fn(1)
        results.append((name, all(torch.equal(fn(n), ref) for n in (2, 3, 4, 8, 16, 32))))
    return results


def markdown(rows: list[dict]) -> str:
    lines = [HEADER]
    for r in rows:
        holds = f"{'yes' if r['invariant_holds'] else 'NO'}, {'yes' if r['default_holds'] else 'no'}"
        lines.append(
            f"| {r['arch']} | {r['batch']} | {r['mode']} | {r['default_img_s']:.1f} "
            f"| {r['invariant_img_s']:.1f} | {r['ratio']:.3f} | {holds} |"
        )
    return "\n".join(lines)


HEADER = (
    "| base | batch | pass | default img/s | invariant img/s | invariant / default "
    "| alone == in batch: invariant, default |\n|---|--:|---|--:|--:|--:|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--archs", default="deit_tiny_patch16_224,vit_base_patch32_224")
    parser.add_argument("--batches", default="16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ops", action="store_true", help="print which ops change with the batch, and stop")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.ops:
        print(f"| op ({args.device}) | alone == in batches of 2..32 |\n|---|---|")
        for name, same in op_probe(args.device):
            print(f"| {name} | {'yes' if same else 'NO'} |")
        return
    print(environment(pin_malloc(), args.device, "fp32", f"{args.rounds} rounds"))
    print(HEADER, flush=True)
    for arch in args.archs.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(markdown(bench(arch, batch, args.rounds, args.device)).split("\n", 2)[2], flush=True)


if __name__ == "__main__":
    main()
