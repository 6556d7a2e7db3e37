"""Preparing adapters for an engine: memory projected to keys and values once, on its device.

``MemoryViT`` inherits this: an adapter's memory does not depend on the image, so its keys and values
through each block's norm1 and qkv are computed here, when the adapter is made ready, and a pass only
reads them (docs/design.md §2.2). Serving and training share it; while training, the prepared
tensors keep the autograd graph back to the adapter's parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor

from ..invariant import mode as invariant
from ..sets.adapter_set import AdapterSet
from ..sets.stack import PreparedAdapter
from ..stored.memory_projection import StackedProjection
from ..weights.adapter import AdapterWeights
from ..weights.spec import ViTSpec


class AdapterPreparation:
    """``prepare``, ``prepare_many``, ``prepare_set`` and the memory projection of ``MemoryViT``."""

    # What it reads of the engine (memory_core/engine/model.py).
    base: VisionTransformer
    spec: ViTSpec
    device: torch.device
    dtype: torch.dtype
    batch_invariant: bool
    _stacked_projection: StackedProjection

    def class_position(self) -> Tensor:
        """(D,) the position embedding the base's class token gets, which adapter class tokens share."""
        base = self.base
        if base.pos_embed is None or base.no_embed_class:
            return torch.zeros(self.spec.width, device=self.device, dtype=self.dtype)
        return base.pos_embed[0, 0]

    def prepare(self, weights: AdapterWeights) -> PreparedAdapter:
        """Check ``weights`` against the base and precompute what the fused pass needs. Changes nothing.

        Serving and training share it: when some tensor of ``weights`` requires grad (an adapter being
        trained) and grad mode is on, the prepared tensors keep the graph back to the parameters, so
        the loss reaches the memory through its projected keys and values.
        """
        weights.check_fits(self.spec)
        like = {"device": self.device, "dtype": self.dtype}
        with torch.set_grad_enabled(torch.is_grad_enabled() and weights.requires_grad):
            keys, values, rows = self._project(weights.memory.to(**like), weights.memory_norm)
            return self._prepared(weights, keys, values, rows)

    def prepare_many(self, weights: Sequence[AdapterWeights], *, chunk: int = 512) -> list[PreparedAdapter]:
        """``prepare`` for many adapters (start-up with thousands of bundles), in the same order.

        Memory tokens are projected independently of one another, so the memories of many adapters
        go through each block's norm and qkv together: one matmul per layer and chunk instead of
        one per adapter and layer, which is what dominates preparing small adapters one by one (and,
        for the adapters a training step prepares, what it costs on top of the pass).
        """
        for w in weights:
            w.check_fits(self.spec)
        like = {"device": self.device, "dtype": self.dtype}
        prepared: list[PreparedAdapter | None] = [None] * len(weights)
        grad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        with torch.set_grad_enabled(grad):
            for start in range(0, len(weights), chunk):
                group = range(start, min(start + chunk, len(weights)))
                for norm in sorted({weights[i].memory_norm for i in group}):
                    members = [i for i in group if weights[i].memory_norm == norm]
                    sizes = [weights[i].num_memory for i in members]
                    memory = torch.cat([weights[i].memory.to(**like) for i in members], dim=1)  # (L, Σm, D)
                    keys, values, rows = self._project(memory, norm)  # (L, H, Σm, d), rows or None
                    # Own copies when serving: a view would keep the whole chunk alive after its
                    # neighbours are gone. Training keeps the views: its graph holds the chunk anyway.
                    split_k = [k if grad else k.clone() for k in keys.split(sizes, dim=2)]
                    split_v = [v if grad else v.clone() for v in values.split(sizes, dim=2)]
                    split_r = [None] * len(sizes) if rows is None else rows.split(sizes, dim=1)
                    for i, k, v, r in zip(members, split_k, split_v, split_r, strict=True):
                        prepared[i] = self._prepared(weights[i], k, v, r)
        return prepared  # type: ignore[return-value]  # every slot is filled above

    def prepare_set(self, weights: Iterable[AdapterWeights], *, version: int | None = None) -> AdapterSet:
        """Prepare every adapter (``prepare_many``) and make them one snapshot, in the given order
        (parents before their extensions): what ``forward`` takes. Installs nothing anywhere."""
        return AdapterSet(tuple(self.prepare_many(list(weights))), version=version)

    def _prepared(
        self, weights: AdapterWeights, keys: Tensor, values: Tensor, rows: Tensor | None = None
    ) -> PreparedAdapter:
        like = {"device": self.device, "dtype": self.dtype}
        return PreparedAdapter(
            name=weights.name,
            parent=weights.parent,
            weights=weights,
            cls=weights.cls_token.to(**like) + self.class_position(),
            memory_keys=keys,
            memory_values=values,
            memory_inputs=rows,
            head_weight=weights.head_weight.to(**like),
            head_bias=weights.head_bias.to(**like),
        )

    def project_memory(self, memory: Tensor, memory_norm: str) -> tuple[Tensor, Tensor]:
        """Memory (L, m, D) -> keys and values (L, H, m, d) through each block's norm1/qkv."""
        keys, values, _ = self._project(memory, memory_norm)
        return keys, values

    def _project(self, memory: Tensor, memory_norm: str) -> tuple[Tensor, Tensor, Tensor | None]:
        """``project_memory``, plus the rows (L, m, D) the keys and values are projected from when
        training keeps them (the cached block reads those); None when serving."""
        L, m, D = memory.shape
        if m == 0:
            empty = memory.new_zeros(L, self.spec.num_heads, 0, self.spec.head_dim)
            return empty, empty, memory.new_zeros(L, 0, D)
        if torch.is_grad_enabled() and memory.requires_grad and not self.batch_invariant:
            stacked = self._stacked_projection.project(self.base.blocks, memory, memory_norm)
            if stacked is not None:  # training: every layer at once (stored/memory_projection.py)
                return stacked
        blocks = self._blocks() if self.batch_invariant else None  # invariant/; None: one product
        layers = zip(self.base.blocks, memory, strict=True)
        pairs = [invariant.project_memory(block, rows, memory_norm, blocks) for block, rows in layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]), None
