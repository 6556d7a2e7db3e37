"""What a base model must be to host memory adapters, and the numbers that describe it.

``ViTSpec`` is the config dataclass passed whole to everything that needs the base's shape: the
FLOP model, adapter validation, the bundle checks. ``check_supported`` refuses, with the reason,
every model the fused pass would compute wrongly rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ViTSpec:
    """The shape of a timm ViT as far as memory adapters are concerned."""

    arch: str
    depth: int  # L, number of transformer blocks
    width: int  # D, embedding width
    num_heads: int  # H
    head_dim: int  # d; H * d is the attention width (equal to D in every timm ViT we accept)
    mlp_hidden: int  # F, the MLP's hidden width (for gated MLPs, the width of a plain MLP of equal cost)
    num_prefix_tokens: int  # class token + register tokens (+ distillation token)
    num_patches: int
    patch_pixels: int  # in_chans * patch_h * patch_w, the patch embedding's input size
    num_classes: int  # rows of the base head (0 when the model has none)
    img_size: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        """T: base tokens in each layer (prefix tokens + patches)."""
        return self.num_prefix_tokens + self.num_patches

    @classmethod
    def from_model(cls, model: VisionTransformer, arch: str | None = None) -> ViTSpec:
        check_supported(model)
        block = model.blocks[0]
        pe = model.patch_embed
        patch_h, patch_w = pe.patch_size
        in_chans = pe.proj.in_channels
        return cls(
            arch=arch or _arch_name(model),
            depth=len(model.blocks),
            width=model.embed_dim,
            num_heads=block.attn.num_heads,
            head_dim=block.attn.head_dim,
            mlp_hidden=_mlp_hidden(block.mlp, model.embed_dim),
            num_prefix_tokens=model.num_prefix_tokens,
            num_patches=pe.num_patches,
            patch_pixels=in_chans * patch_h * patch_w,
            num_classes=model.num_classes,
            img_size=tuple(pe.img_size),
        )


def _mlp_hidden(mlp: nn.Module, width: int) -> int:
    # A plain MLP costs 2*D*F multiply-adds per token; gated variants (SwiGLU) have more matrices.
    # Counting every Linear keeps the FLOP model right for both.
    macs = sum(m.in_features * m.out_features for m in mlp.modules() if isinstance(m, nn.Linear))
    return macs // (2 * width)


def _arch_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return cfg.get("architecture") or type(model).__name__


def check_supported(model: nn.Module) -> None:
    """Raise ``UnsupportedModelError`` saying why ``model`` cannot host adapters; return if it can."""
    name = type(model).__name__
    if not isinstance(model, VisionTransformer):
        raise UnsupportedModelError(
            f"{name} is not a timm VisionTransformer; memvit supports timm's vit_* and deit_* models "
            "(with or without register tokens)"
        )
    if model.cls_token is None:
        raise UnsupportedModelError(
            f"{_arch_name(model)} has no class token; memory adapters each add a class token that "
            "reads the image the way the base's class token does, so the base must have one"
        )
    if model.global_pool != "token" or model.attn_pool is not None:
        raise UnsupportedModelError(
            f"{_arch_name(model)} pools with global_pool={model.global_pool!r}; adapters read their class "
            "token after the final norm, which matches only class-token pooling ('token')"
        )
    for i, block in enumerate(model.blocks):
        if type(block) is not Block:
            raise UnsupportedModelError(
                f"block {i} is {type(block).__name__}; only timm's pre-norm "
                "timm.models.vision_transformer.Block is supported"
            )
        if type(block.attn) is not Attention:
            raise UnsupportedModelError(
                f"block {i} uses {type(block.attn).__name__}; only timm.layers.Attention is supported"
            )
        if block.attn.num_heads * block.attn.head_dim != model.embed_dim:
            raise UnsupportedModelError(
                f"block {i} has attention width {block.attn.num_heads * block.attn.head_dim} != "
                f"embedding width {model.embed_dim}"
            )
