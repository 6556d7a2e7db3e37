"""Would the demo's adapters gain from the new training recipe? Old and new, trained together.

    python -m benchmarks.demo_recipes            # ~5 minutes on 2 CPU cores (needs the demo extra)

For each demo adapter (``digits``, ``orientation``), on the embedded demo base and the very data
``benchmarks/build_demo.py`` trains it on (same folders, steps, batch, crops), every recipe below
trains in ONE fused run (``train_adapters``: same images, same order), and each is scored on the
adapter's validation split:
- shipped: the recipe the shipped bundles were trained with (lr 0.3, class token and memory at the
  head's lr, memory from N(0, 0.02));
- defaults: ``memvit train``'s defaults (lr 0.05, class token x30, memory x1, memory from block inputs);
- defaults at lr 0.1, and at lr 0.3 with the class token at x5 (the same class-token lr as the defaults).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.build_demo import adapter_folders
from benchmarks.common import argument_parser, pin_malloc
from memvit.adapters.training import TrainConfig, train_adapters
from memvit.memory_core import MemoryViT
from memvit.server.demo import BASE_WEIGHTS

RECIPES = {
    "shipped": {"lr": 0.3, "token_lr_scale": 1.0, "memory_lr_scale": 1.0, "memory_init": "normal"},
    "defaults": {},
    "defaults, lr 0.1": {"lr": 0.1},
    "lr 0.3, class token x5": {"lr": 0.3, "token_lr_scale": 5.0},
}
MEMORY = {"digits": 4, "orientation": 2}  # as shipped (server/demo/MANIFEST.json)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args(argv)
    pin_malloc()
    engine = MemoryViT.from_timm(weights=str(BASE_WEIGHTS))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapter_folders(root)  # build_demo's very folders (needs the demo extra: mlxtend)
        print("| adapter | recipe | val top-1 |\n|---|---|--:|")
        for name, memory in MEMORY.items():
            shared = {
                "train_dir": str(root / name / "train"),
                "val_dir": str(root / name / "val"),
                "memory_tokens": memory,
                "steps": args.steps,
                "batch_size": 64,
                "hflip": 0.0,  # as build_demo: a mirrored digit is not a digit
                "crop_scale": (0.8, 1.0),
                "seed": 0,
            }
            configs = [
                TrainConfig(name=f"{name}-{i}", **shared, **overrides)
                for i, overrides in enumerate(RECIPES.values())
            ]
            for recipe, result in zip(RECIPES, train_adapters(engine, configs, progress=False), strict=True):
                print(f"| {name} | {recipe} | {result.val.top1:.4f} |", flush=True)


if __name__ == "__main__":
    main()
