"""MemoryViT: a frozen timm ViT plus any number of memory adapters, in one fused forward pass.

    forward(x, adapter_set, tasks) = run_plan(x, plan_pass(adapter_set, slots, tasks))

An inference pass is planned on the host (``plan.py``: each image's class-token rows, as slots of
the engine's ``AdapterSlots``, ``slots.py``) and run on the device from the plan and the slot pools
alone (``planned.py``): the base tokens through every block exactly as timm computes them, the
class-token rows alongside, the base head and each row's head. A pass that trains adapters runs
their stack instead (``forward_features``/``forward_head``, the split path, docs/design.md §2.3).
The engine holds no adapters of its own: it ``prepare``s them and runs whichever immutable
``AdapterSet`` it is handed, giving each adapter a slot the first time one needs it. Which set is
live, and how it changes, is ``live.py``'s (``LiveAdapters``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from timm.data import resolve_data_config
from torch import Tensor, nn

from . import invariant, triton_kernels
from .adapter import AdapterWeights
from .adapter_set import AdapterSet
from .attention import merged_block, split_block
from .base_model import BaseModel, create_base
from .cached import CachedBatch, forward_cached
from .errors import AdapterShapeError, InputError
from .fingerprint import state_fingerprint
from .invariant import InvariantBlocks
from .memory_projection import StackedProjection
from .output import FusedOutput
from .plan import PassPlan, plan_pass
from .planned import planned_forward
from .slots import AdapterSlots
from .spec import ViTSpec
from .stack import AdapterStack, PreparedAdapter

_BASE_ONLY = AdapterSet()  # what a pass without a set runs: no adapters


class MemoryViT(nn.Module):
    """A frozen timm ViT that serves its own task and every adapter of the set it is given, in one pass."""

    def __init__(
        self,
        base: BaseModel,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        # Opt-in: every image's logits bit-identical whatever shares its pass (invariant.py), at a cost.
        self.batch_invariant = batch_invariant
        self.invariant_blocks: InvariantBlocks | None = None  # None: the device's defaults
        # The class-token attention and heads of an inference pass: "torch", "triton" or "auto"
        # (Triton on CUDA). Both compute the same numbers (planned.py); tests run Triton on CPU too.
        self.kernels = "auto"
        self._slots: AdapterSlots | None = None  # built for the device and dtype on first use
        self.spec = ViTSpec.from_model(base.model, base.arch)  # raises UnsupportedModelError
        self.base = base.model.eval().requires_grad_(False)
        self._stacked_projection = StackedProjection()  # training's memory projection, built on first use
        self.labels = base.labels
        self.source = base.source
        self._data_config_overrides = dict(base.data_config or {})
        # Fingerprint the weights as given, before any cast, so it names the weights, not the dtype.
        self.fingerprint = state_fingerprint(self.base.state_dict())
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    @classmethod
    def from_timm(
        cls,
        arch: str | None = None,
        *,
        weights: str | Path | None = None,
        pretrained: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        labels: tuple[str, ...] | None = None,
        data_config: dict[str, Any] | None = None,
        batch_invariant: bool = False,
        **model_kwargs: Any,
    ) -> MemoryViT:
        """Build from a timm architecture name and (optionally) a local weights file."""
        base = create_base(
            arch,
            weights=weights,
            pretrained=pretrained,
            labels=labels,
            data_config=data_config,
            **model_kwargs,
        )
        return cls(base, device=device, dtype=dtype, batch_invariant=batch_invariant)

    # -- device, dtype, mode -------------------------------------------------------------------
    # ``.to()``/``.half()`` are nn.Module's own and move the base only. Adapters stay prepared for the
    # device and dtype they were prepared on, and a pass refuses them after a move (forward_features):
    # ``LiveAdapters.move_to`` moves an engine and re-prepares its live set in one step.
    @property
    def device(self) -> torch.device:
        return self.base.cls_token.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.cls_token.dtype

    def train(self, mode: bool = True) -> MemoryViT:
        # The base is frozen: its dropout and drop-path stay off even while adapters train.
        super().train(mode)
        self.base.eval()
        return self

    def data_config(self) -> dict[str, Any]:
        """The base's own preprocessing (timm's data config): input size, interpolation, crop, mean, std."""
        config = resolve_data_config(model=self.base)
        config.update(self._data_config_overrides)
        config["input_size"] = (self.base.patch_embed.proj.in_channels, *self.spec.img_size)
        return config

    # -- preparing adapters --------------------------------------------------------------------
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
            if stacked is not None:  # training: every layer at once (memory_projection.py)
                return stacked
        blocks = self._blocks() if self.batch_invariant else None  # invariant.py; None: one product
        layers = zip(self.base.blocks, memory, strict=True)
        pairs = [invariant.project_memory(block, rows, memory_norm, blocks) for block, rows in layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]), None

    # -- the fused pass ------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor | CachedBatch,
        adapter_set: AdapterSet | None = None,
        *,
        tasks: Sequence[Collection[str]] | None = None,
        path: str = "auto",
    ) -> FusedOutput:
        """Images (B, C, H, W) -> base logits and adapter logits, from one pass.

        ``adapter_set``: the snapshot to run (e.g. ``LiveAdapters.current``, read once by the caller);
        None runs the base alone. ``tasks``: None computes every adapter for every image; otherwise
        ``tasks[b]`` names the adapters image b asks for, and only those rows (plus, in extension
        mode, their ancestors') are built: an image pays for the base pass plus what it asks for,
        whatever else the set holds. ``path``: "auto"/"merged" (class-token rows share the base's
        linear layers) or "split" (kept apart, as training computes them; docs/design.md §2.3).

        ``x`` may also be a ``CachedBatch``: the base's cached activations for a batch of images
        (training and evaluation from an activation cache, docs/design.md §2.9). Then only the
        class-token path runs, and every adapter answers every image.
        """
        adapter_set = _BASE_ONLY if adapter_set is None else adapter_set
        if isinstance(x, CachedBatch):
            if tasks is not None:
                raise ValueError("a cached batch runs every adapter for every image: tasks must be None")
            return forward_cached(self, x, adapter_set)
        if path not in ("auto", "merged", "split"):
            raise ValueError(f"path must be 'auto', 'merged' or 'split', got {path!r}")
        if torch.is_grad_enabled() and adapter_set.requires_grad:  # training: the stack, split
            if tasks is not None:
                raise ValueError(
                    "a pass that trains adapters runs every adapter for every image: tasks must be None"
                )
            x_tokens, c_tokens = self.forward_features(x, adapter_set.stack, path=path)
            return self.forward_head(x_tokens, c_tokens, adapter_set)
        self._check_input(x)
        plan = plan_pass(adapter_set, self.slots, tasks, x.shape[0])  # None: nobody asked for an adapter
        base_logits, adapter_logits = self.run_plan(x, plan, path="split" if path == "split" else "merged")
        return FusedOutput.of_plan(base_logits, adapter_logits, plan, adapter_set)

    def run_plan(
        self, x: Tensor, plan: PassPlan | None, *, path: str = "merged"
    ) -> tuple[Tensor, Tensor | None]:
        """The device part of a pass: images and a plan -> base logits (B, C_0) and the adapter logits
        of the plan's output rows (planned.py), or None without a plan (the base alone)."""
        base = self.base
        blocks = self._blocks() if self.batch_invariant and path == "merged" else None
        if plan is None:
            if blocks is not None:
                x_tokens, _ = invariant.features(base, x.to(self.dtype), None, blocks)
                return invariant.head(base, x_tokens, blocks), None
            return base.forward_head(base.norm(base.blocks(self.embed(x)))), None
        tensors = plan.tensors(self.device)
        if blocks is not None:
            return invariant.planned(base, x.to(self.dtype), tensors, plan.shape, plan.pools, blocks)
        return planned_forward(
            base, self.embed(x), tensors, plan.shape, plan.pools, kernels=self.resolved_kernels, path=path
        )

    @property
    def slots(self) -> AdapterSlots:
        """The device slots of the adapters this engine runs (slots.py), for its current device and
        dtype: after a move, new (empty) slots, filled again as passes need them."""
        slots = self._slots
        if slots is None or slots.device != self.device or slots.dtype != self.dtype:
            slots = self._slots = AdapterSlots(self.spec, self.device, self.dtype)
        return slots

    @property
    def resolved_kernels(self) -> str:
        """The class-token attention and heads' implementation (planned.py): ``kernels`` unless "auto",
        which is Triton on CUDA (when installed) and torch elsewhere."""
        if self.kernels != "auto":
            return self.kernels
        return "triton" if self.device.type == "cuda" and triton_kernels.available() else "torch"

    def forward_features(
        self, x: Tensor, stack: AdapterStack | None, *, path: str = "auto"
    ) -> tuple[Tensor, Tensor | None]:
        """Images -> final-normed base tokens (B, T, D) and the stack's class tokens (B, K, D) or None.

        Every adapter of ``stack`` for every image, from their prepared tensors: the training pass
        (gradients flow into the stack) and callers that want the tokens. ``path``: "merged" runs base
        and class-token rows through each linear layer together; "split" keeps them apart so that
        autograd records only the class-token rows (docs/design.md §2.3); "auto" picks split exactly
        when gradients will flow into the stack.
        """
        base = self.base
        if stack is not None:
            self._check_stack(stack)
        training = stack is not None and torch.is_grad_enabled() and stack.requires_grad
        if self.batch_invariant and path != "split" and not training:  # a training pass stays split
            self._check_input(x)
            return invariant.features(base, x.to(self.dtype), stack, self._blocks())
        x = self.embed(x)  # (B, T, D)
        if stack is None:
            return base.norm(base.blocks(x)), None
        c = base.norm_pre(stack.cls.expand(x.shape[0], -1, -1))  # (B, K, D)
        if path == "auto":
            path = "split" if training else "merged"
        if path == "split":
            for block, memory in zip(base.blocks, stack.layers, strict=True):
                x, c = split_block(block, x, c, memory)
        elif path == "merged":
            T = x.shape[1]
            z = torch.cat([x, c], dim=1)  # (B, T+K, D)
            for block, memory in zip(base.blocks, stack.layers, strict=True):
                z = merged_block(block, z, T, memory)
            x, c = z[:, :T], z[:, T:]
        else:
            raise ValueError(f"path must be 'auto', 'merged' or 'split', got {path!r}")
        return base.norm(x), base.norm(c)

    def embed(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> the base tokens (B, T, D) the first block reads."""
        self._check_input(x)
        base = self.base
        return base.norm_pre(base.patch_drop(base._pos_embed(base.patch_embed(x.to(self.dtype)))))

    def forward_head(self, x: Tensor, c: Tensor | None, adapter_set: AdapterSet) -> FusedOutput:
        """``forward_features``' tokens -> logits: the base head, and each adapter's head on its row."""
        blocks = self._blocks() if self.batch_invariant else None
        base_logits = self.base.forward_head(x) if blocks is None else invariant.head(self.base, x, blocks)
        if c is None:  # no adapter rows: the base alone
            return FusedOutput(base_logits, {}, {}, adapter_set)
        stack = adapter_set.stack
        heads = stack.apply_heads(c) if blocks is None else invariant.adapter_heads(stack, c, blocks)
        return FusedOutput.every_image(
            base_logits, dict(zip(adapter_set.names, heads, strict=True)), adapter_set
        )

    def _blocks(self) -> InvariantBlocks:  # the batch-invariant mode's call sizes (invariant.py)
        return self.invariant_blocks or InvariantBlocks.for_device(self.device)

    def _check_stack(self, stack: AdapterStack) -> None:
        if stack.cls.device != self.device or stack.cls.dtype != self.dtype:
            # A set prepared before the engine moved (all adapters of a stack share one device/dtype).
            raise AdapterShapeError(
                f"these adapters were prepared for {stack.cls.device}/{stack.cls.dtype}, the engine runs "
                f"{self.device}/{self.dtype}: prepare them with this engine (LiveAdapters.move_to moves an "
                "engine and re-prepares its live adapters)",
                field="name",
            )

    def _check_input(self, x: Tensor) -> None:
        in_chans = self.base.patch_embed.proj.in_channels
        if x.ndim != 4 or x.shape[1] != in_chans:
            raise InputError(f"expected images (B, {in_chans}, H, W), got shape {tuple(x.shape)}")
        if not self.base.dynamic_img_size and tuple(x.shape[2:]) != self.spec.img_size:
            raise InputError(
                f"expected {self.spec.img_size[0]}x{self.spec.img_size[1]} images for {self.spec.arch}, "
                f"got {x.shape[2]}x{x.shape[3]}"
            )
        if x.device != self.device:
            raise InputError(f"images are on {x.device} but the model is on {self.device}")
