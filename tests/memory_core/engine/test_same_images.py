"""Two identical images in one pass get the same answers, bit for bit (what a server's request with
the same picture twice shows its client), whatever the batch around them and the adapters asked.

On this machine's two threads the CPU's small products, one over every image's rows, round a row by
where it sits: the trimmed last block (memory_core/block/merged.py ``merged_last_block``, the CPU's
default) runs its few rows' products per image, and the whole block keeps every product large. A
trimmed block with one product over all its rows failed this test (~3e-7 apart)."""

from __future__ import annotations

import pytest
import torch

from memvit.memory_core import MemoryViT
from tests.conftest import random_adapter
from tests.factories import TINY


def _differing(engine: MemoryViT) -> list[tuple]:
    adapters = [random_adapter("stable", engine, m=2), random_adapter("flip", engine, m=4, seed=11)]
    adapters += [random_adapter(f"hot-{i}", engine, m=i % 3) for i in range(3)]
    torch.manual_seed(0)
    x1 = torch.randn(1, 3, *engine.spec.img_size)
    found = []
    for k in range(2, 6):
        loaded = engine.prepare_set(adapters[:k])
        for B in range(2, 9):
            x = torch.cat([x1, x1, torch.randn(B - 2, 3, *engine.spec.img_size)])
            for tasks in (None, [loaded.names, loaded.names] + [loaded.names[:1]] * (B - 2)):
                with torch.inference_mode():
                    out = engine(x, loaded, tasks=tasks)
                if not torch.equal(out.base[0], out.base[1]):
                    found.append((k, B, "base"))
                for name, logits in out.adapters.items():
                    who = out.images[name].tolist()
                    if not torch.equal(logits[who.index(0)], logits[who.index(1)]):
                        found.append((k, B, name))
    return found


@pytest.mark.parametrize("trim", [None, True, False])  # the default (trimmed on the CPU), on, off
def test_identical_images_in_one_pass_get_identical_answers(trim) -> None:
    engine = MemoryViT.from_timm("vit_tiny_patch16_224", **TINY).eval()
    engine.trim_last_block = trim
    assert _differing(engine) == []
