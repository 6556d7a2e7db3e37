"""The dense-mask reference: the paper's method written the literal way. Test oracle and baseline.

Every layer sees one long sequence ``[base tokens ; C_1..C_K ; M_1..M_K]`` and one boolean mask
built from the paper's token table (rows are queries, columns keys):

    query \\ key      | base tokens | C_k | M_k | C_j, M_j (j != k)
    base tokens       | yes         | no  | no  | no
    C_k               | yes         | yes | yes | only if j is an ancestor of k (extension mode)

Memory tokens are fed in fresh at every layer and dropped after it: they are keys and values, never
queries (their rows of the mask only let them see themselves, to keep the softmax finite; their
outputs are thrown away). ``memory_norm = "norm1"`` memory passes through the block's norm1 with
the tokens, ``"none"`` memory joins after it. As in the paper's figure and its public reproduction,
the memory rows go through the whole layer (MLP included) before being dropped; ``trim_memory``
drops them right after attention instead, the cheapest a dense-mask form can be.

This file shares no code with the fused pass on purpose: it is what the fused pass is checked
against. It costs (T+K+sum m)^2 attention per layer and its mask rules out fast attention kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor

from ..weights.adapter import AdapterWeights

BASE, CLS, MEM = 0, 1, 2


def token_roles(num_base: int, adapters: Sequence[AdapterWeights]) -> tuple[Tensor, Tensor]:
    """(kind, owner) per position of ``[base ; C_1..C_K ; M_1..M_K]``; owner is -1 for base tokens."""
    kinds = [BASE] * num_base + [CLS] * len(adapters)
    owners = [-1] * num_base + list(range(len(adapters)))
    for k, a in enumerate(adapters):
        kinds += [MEM] * a.num_memory
        owners += [k] * a.num_memory
    return torch.tensor(kinds), torch.tensor(owners)


def visibility(adapters: Sequence[AdapterWeights]) -> Tensor:
    """(K, K) bool: adapter k's class token may see adapter j's tokens (j is k or an ancestor of k)."""
    index = {a.name: i for i, a in enumerate(adapters)}
    sees = torch.eye(len(adapters), dtype=torch.bool)
    for k, a in enumerate(adapters):
        parent = a.parent
        while parent is not None:
            sees[k, index[parent]] = True
            parent = adapters[index[parent]].parent
    return sees


def attention_mask(num_base: int, adapters: Sequence[AdapterWeights]) -> Tensor:
    """(N, N) bool, True where the query (row) may attend to the key (column). From the table above."""
    kind, owner = token_roles(num_base, adapters)
    q_kind, k_kind = kind[:, None], kind[None, :]
    sees = visibility(adapters)
    owner_sees = sees[owner.clamp(min=0)[:, None], owner.clamp(min=0)[None, :]]  # meaningful off-base only
    base_row = (q_kind == BASE) & (k_kind == BASE)
    cls_row = (q_kind == CLS) & ((k_kind == BASE) | owner_sees & (k_kind != BASE))
    mem_row = (q_kind == MEM) & torch.eye(len(kind), dtype=torch.bool)
    return base_row | cls_row | mem_row


class DenseMemoryViT:
    """Base model plus adapters, computed densely. ``__call__(x) -> (base_logits, {name: logits})``.

    Differentiable when the adapters' tensors require gradients: that is the "back-propagate through
    the whole masked model" baseline of the training benchmark.
    """

    def __init__(
        self, base: VisionTransformer, adapters: Sequence[AdapterWeights], *, trim_memory: bool = False
    ) -> None:
        self.base = base.eval()
        self.trim_memory = trim_memory
        self.adapters = list(adapters)
        names = [a.name for a in self.adapters]
        for a in self.adapters:
            if a.parent is not None and a.parent not in names:
                raise ValueError(f"{a.name} extends {a.parent}, which is not in the set")
        like = {"device": base.cls_token.device, "dtype": base.cls_token.dtype}
        self.num_base = base.num_prefix_tokens + base.patch_embed.num_patches
        self.mask = attention_mask(self.num_base, self.adapters).to(like["device"])
        self.cls_position = (
            base.pos_embed[0, 0] if base.pos_embed is not None and not base.no_embed_class else 0.0
        )
        K = len(self.adapters)
        self.cls = (
            torch.stack([a.cls_token for a in self.adapters]).to(**like) + self.cls_position
            if K
            else torch.zeros(0, base.embed_dim, **like)
        )
        depth = len(base.blocks)
        # Per layer: all adapters' memory rows, and which of them pass through norm1.
        self.memory = [
            torch.cat([a.memory[layer] for a in self.adapters], dim=0).to(**like)
            if K
            else torch.zeros(0, base.embed_dim, **like)
            for layer in range(depth)
        ]
        self.memory_normed = torch.tensor(
            [a.memory_norm == "norm1" for a in self.adapters for _ in range(a.num_memory)], dtype=torch.bool
        ).to(like["device"])  # (sum m,)

    def __call__(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        base = self.base
        images = images.to(base.cls_token.dtype)
        x = base._pos_embed(base.patch_embed(images))  # (B, T, D)
        B = x.shape[0]
        x = base.norm_pre(torch.cat([x, self.cls.expand(B, -1, -1)], dim=1))  # (B, T+K, D)
        for block, memory in zip(base.blocks, self.memory, strict=True):
            x = self._dense_mask_block(block, x, memory)
        x = base.norm(x)
        base_logits = base.forward_head(x[:, : self.num_base])
        adapter_logits = {
            a.name: F.linear(x[:, self.num_base + k], a.head_weight.to(x), a.head_bias.to(x))
            for k, a in enumerate(self.adapters)
        }
        return base_logits, adapter_logits

    def _dense_mask_block(self, block, x: Tensor, memory: Tensor) -> Tensor:
        attn = block.attn
        B, N, D = x.shape
        seq = torch.cat([x, memory.expand(B, -1, -1)], dim=1)  # (B, S, D), S = N + sum m
        S = seq.shape[1]
        h = block.norm1(seq)
        # memory_norm "none": that adapter's memory joins after norm1, unnormalised.
        h = torch.cat([h[:, :N], torch.where(self.memory_normed[:, None], h[:, N:], seq[:, N:])], dim=1)
        qkv = attn.qkv(h).reshape(B, S, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, S, d)
        q, k = attn.q_norm(q), attn.k_norm(k)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)  # (B, H, S, d)
        rows = N if self.trim_memory else S
        seq, h = seq[:, :rows], h[:, :rows]
        o = attn.norm(o[:, :, :rows].transpose(1, 2).reshape(B, rows, D))
        if getattr(attn, "gate", None) is not None:
            o = o * attn.gate(h).sigmoid()
        seq = seq + block.ls1(attn.proj(o))
        seq = seq + block.ls2(block.mlp(block.norm2(seq)))
        return seq[:, :N]  # memory outputs are dropped: fresh memory enters the next layer
