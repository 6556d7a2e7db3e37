"""Where fresh memory starts: how far an untrained adapter is from the base, per initialisation.

    python -m benchmarks.memory_init                 # real DeiT-Tiny, 64 CIFAR-10 test images, ~1 minute

An untrained adapter (the base's class token, fresh memory, before any step) should start where the
base is, so that training spends its steps on the task rather than on undoing its start. For each
initialisation (``adapters/training/memory_init.py``) and memory norm, on real images:
- feature cosine: the adapter's final class-token feature against the base's (1 = the base's);
- base-head agreement: the base's own head applied to the adapter's feature, top-1 against the
  base's top-1 (what the untrained adapter "thinks" the image is);
- memory share: the part of the class token's attention that goes to memory, per block (mean over
  images and heads), shown for the mean over blocks, the largest block and the last three blocks.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import CIFAR10, argument_parser, deit_tiny_engine, environment, pin_malloc
from benchmarks.datasets import cifar_tar_to_folder
from memvit.adapters.preprocess import eval_transform
from memvit.adapters.training.data import ImageDataset, scan_folder
from memvit.adapters.training.memory_init import token_memory
from memvit.memory_core import AdapterSet, AdapterWeights, MemoryViT
from memvit.memory_core.block.attention import project_qkv, split_block


@torch.no_grad()
def probe(engine: MemoryViT, weights: AdapterWeights, images: torch.Tensor) -> dict[str, float]:
    """Step-0 distance of ``weights`` from the base on ``images`` (one adapter, split path)."""
    base = engine.base
    stack = AdapterSet((engine.prepare(weights),)).stack
    x = base.norm_pre(base._pos_embed(base.patch_embed(images)))
    c = base.norm_pre(stack.cls.expand(images.shape[0], -1, -1))  # (B, 1, D)
    shares = []
    for block, memory in zip(base.blocks, stack.layers, strict=True):
        _, k_x, _ = project_qkv(block.attn, block.norm1(x))
        q_c, k_c, _ = project_qkv(block.attn, block.norm1(c))
        q = q_c * block.attn.scale  # (B, H, 1, d)
        scores = torch.cat(
            [
                q @ k_x.transpose(-2, -1),  # (B, H, 1, T)
                (q * k_c).sum(-1, keepdim=True),  # (B, H, 1, 1): itself
                torch.einsum("bhkd,khpd->bhkp", q, memory.keys),  # (B, H, 1, m)
            ],
            dim=-1,
        ).softmax(-1)
        m = memory.keys.shape[2]
        shares.append(float(scores[..., scores.shape[-1] - m :].sum(-1).mean()) if m else 0.0)
        x, c = split_block(block, x, c, memory)
    base_feature = base.norm(x)[:, 0]
    adapter_feature = base.norm(c)[:, 0]
    cosine = F.cosine_similarity(adapter_feature, base_feature, dim=-1).mean()
    agree = (base.forward_head(base.norm(x)).argmax(-1) == base.head(adapter_feature).argmax(-1)).float()
    return {
        "cosine": float(cosine),
        "agree": float(agree.mean()),
        "share_mean": sum(shares) / len(shares),
        "share_max": max(shares),
        "share_last3": sum(shares[-3:]) / 3,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--memory", type=int, nargs="+", default=[1, 5])
    args = parser.parse_args(argv)
    malloc = pin_malloc()
    torch.set_grad_enabled(False)
    engine = deit_tiny_engine()
    with tempfile.TemporaryDirectory(prefix="memvit-init-") as tmp:
        folder = cifar_tar_to_folder(
            CIFAR10 / "cifar10_jpg_test_10k.tar.gz", Path(tmp) / "test", per_class=args.images // 10 + 2
        )
        dataset = ImageDataset(scan_folder(folder), eval_transform(engine))
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    # Two disjoint halves: memory drawn from one, scored on the other (drawn tokens are not the
    # scored images' own).
    draw, scored = images[::2][:16], images[1::2][: args.images]
    print(environment("deit_tiny_patch16_224 (ImageNet weights)", f"{len(scored)} CIFAR-10 images", malloc))
    print(
        "| memory | init | memory_norm | feature cosine | base-head agreement "
        "| memory share: mean / max / last 3 blocks |"
    )
    print("|--:|---|---|--:|--:|---|")
    for m in args.memory:
        for init in ("normal", "tokens"):
            for norm in ("norm1", "none"):
                weights = AdapterWeights.initialise(
                    "probe",
                    engine.spec,
                    num_memory=m,
                    num_classes=10,
                    cls_token=engine.base.cls_token,
                    memory_norm=norm,
                    generator=torch.Generator().manual_seed(0),
                )
                if init == "tokens":
                    memory = token_memory(engine, draw, m, norm, torch.Generator().manual_seed(1))
                    weights = AdapterWeights(
                        "probe", memory, weights.cls_token, weights.head_weight, weights.head_bias, norm
                    )
                r = probe(engine, weights, scored)
                print(
                    f"| {m} | {init} | {norm} | {r['cosine']:.3f} | {r['agree']:.3f} "
                    f"| {r['share_mean']:.3f} / {r['share_max']:.3f} / {r['share_last3']:.3f} |",
                    flush=True,
                )
    weights = AdapterWeights.initialise(
        "probe", engine.spec, num_memory=0, num_classes=10, cls_token=engine.base.cls_token
    )
    r = probe(engine, weights, scored)
    print(f"| 0 | - | - | {r['cosine']:.3f} | {r['agree']:.3f} | - |")


if __name__ == "__main__":
    main()
