"""Where a new adapter's memory tokens start.

``normal``: the paper's N(0, 0.02). Under ``memory_norm="norm1"`` the block's LayerNorm rescales such
a small random vector to full size, so fresh memory acts like a full-size random token: it draws a
large share of the class token's attention and moves its features before training has taught it
anything, and the first steps go into undoing that (RESULTS §2.5).

``tokens``: each layer's memory starts as real token inputs of that block, drawn from the base's
pass over a few training images. At step 0 a memory token's key and value are then those of a token
the class token already sees, so the adapter starts close to the base. Under ``memory_norm="norm1"``
the drawn token is stored standardised and scaled to the paper's N(0, 0.02) size: LayerNorm does
not see the scale (so the key is the real token's), while SGD does (a LayerNorm'd parameter's
effective step shrinks with the square of its norm, and real tokens are 30-70x larger than 0.02 per
feature), so the paper's learning rates keep their meaning. Under ``memory_norm="none"`` the drawn
tokens are stored as the block's norm1 outputs, so their keys and values at step 0 are the same as
under norm1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memvit.memory_core import MemoryViT
from memvit.memory_core.weights.adapter import MEMORY_INIT_STD

MEMORY_INITS = ("normal", "tokens")


@torch.no_grad()
def block_inputs(engine: MemoryViT, images: Tensor) -> list[Tensor]:
    """The base tokens entering each block (without class and register tokens): L x (B*N, D)."""
    base = engine.base
    captured: list[Tensor] = []
    hooks = [
        block.register_forward_pre_hook(lambda _, args: captured.append(args[0])) for block in base.blocks
    ]
    try:
        base.forward_features(images.to(engine.device, engine.dtype))
    finally:
        for hook in hooks:
            hook.remove()
    prefix = base.num_prefix_tokens
    return [x[:, prefix:].reshape(-1, x.shape[-1]) for x in captured]


@torch.no_grad()
def token_memory(
    engine: MemoryViT, images: Tensor, num_memory: int, memory_norm: str, generator: torch.Generator
) -> Tensor:
    """(L, m, D) memory drawn from the tokens entering each block on ``images`` (without replacement)."""
    layers = []
    for block, tokens in zip(engine.base.blocks, block_inputs(engine, images), strict=True):
        if num_memory > tokens.shape[0]:
            raise ValueError(
                f"{num_memory} memory tokens from {tokens.shape[0]} image tokens: use more images"
            )
        picked = tokens[torch.randperm(tokens.shape[0], generator=generator)[:num_memory]]
        if memory_norm == "none":
            layers.append(block.norm1(picked))
        else:  # the direction LayerNorm sees, at the paper's initial scale
            centred = picked - picked.mean(-1, keepdim=True)
            layers.append(centred / centred.std(-1, keepdim=True) * MEMORY_INIT_STD)
    return torch.stack(layers).float().cpu()
