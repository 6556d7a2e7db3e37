"""Memory drawn from real block inputs: each layer's memory is a token that layer really sees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memvit.adapters.training import TrainConfig, TrainingError, train_adapter
from memvit.adapters.training.memory_init import block_inputs, token_memory
from memvit.memory_core import MemoryViT
from tests.conftest import images, tiny_engine


@pytest.mark.parametrize("memory_norm", ["norm1", "none"])
def test_token_memory_is_drawn_from_each_blocks_inputs(memory_norm) -> None:
    engine = tiny_engine()
    x = images(engine, batch=3)
    inputs = block_inputs(engine, x)
    assert len(inputs) == engine.spec.depth
    # Patch tokens only (the class token is not drawn): B * N rows per layer.
    assert inputs[0].shape == (3 * engine.base.patch_embed.num_patches, engine.spec.width)
    memory = token_memory(engine, x, 4, memory_norm, torch.Generator().manual_seed(0))
    assert memory.shape == (engine.spec.depth, 4, engine.spec.width)
    # What the block makes of each memory token is what it makes of a token it really sees: exactly
    # under "none"; under norm1 up to LayerNorm's eps (1e-6 against a variance of 0.02^2: 0.1%).
    tol = 0.0 if memory_norm == "none" else 2e-2
    for layer, (block, tokens) in enumerate(zip(engine.base.blocks, inputs, strict=True)):
        seen = block.norm1(tokens)
        made = memory[layer] if memory_norm == "none" else block.norm1(memory[layer])
        for row in made:
            assert ((seen - row).abs().amax(-1) <= tol).any(), "a memory token no layer input is"
        assert len({tuple(r.tolist()) for r in memory[layer]}) == 4  # drawn without replacement
    if memory_norm == "norm1":  # at the paper's initial scale, so its learning rates keep their meaning
        assert memory.std(-1).mean().item() == pytest.approx(0.02, rel=1e-3)
    # Under either norm a memory token's key at step 0 is the key of the token it was drawn from.
    same = token_memory(engine, x, 4, "norm1", torch.Generator().manual_seed(0))
    other = token_memory(engine, x, 4, "none", torch.Generator().manual_seed(0))
    k1, _ = engine.project_memory(same, "norm1")
    k2, _ = engine.project_memory(other, "none")
    assert torch.allclose(k1, k2, atol=1e-2, rtol=1e-2)


def test_tokens_init_trains_and_is_recorded(image_folder, tiny_weights) -> None:
    engine = MemoryViT.from_timm(weights=str(tiny_weights))
    config = TrainConfig(name="drawn", train_dir=str(image_folder), steps=3, batch_size=8)
    config = dataclasses.replace(config, memory_tokens=2, memory_init="tokens")
    result = train_adapter(engine, config, progress=False)
    assert result.bundle.training["hyper_parameters"]["memory_init"] == "tokens"
    # Real tokens' directions at the paper's scale: every token standardised to std 0.02 at the start.
    assert 0.01 < result.bundle.weights.memory.std().item() < 0.04
    with pytest.raises(TrainingError, match="memory_init must be one of"):
        TrainConfig(name="x", train_dir=str(image_folder), memory_init="zeros")
