"""MemoryViT: a frozen timm ViT plus any number of memory adapters, in one fused forward pass.

    forward(x, adapter_set, tasks) = run_plan(x, plan_pass(adapter_set, slots, tasks))

An inference pass is planned on the host (routing/planner.py: each image's class-token rows, as
slots of the engine's ``AdapterSlots``, routing/slots.py) and run on the device from the plan and
the slot pools alone (``run_plan``, engine/slot_passes.py, over routing/planned.py): the base tokens
through every block exactly as timm computes them, the class-token rows alongside, the base head
and each row's head. A pass that trains adapters runs their stack instead
(``forward_features``/``forward_head``, the split path, docs/design.md §2.3).
The engine holds no adapters of its own: it ``prepare``s them and runs whichever immutable
``AdapterSet`` it is handed, giving each adapter a slot the first time one needs it. Which set is
live, and how it changes, is engine/live.py's (``LiveAdapters``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from timm.data import resolve_data_config
from torch import Tensor, nn

from ..block.attention import split_block
from ..block.merged import merged_block
from ..errors import AdapterShapeError, InputError
from ..invariant import mode as invariant
from ..invariant.blocks import InvariantBlocks
from ..output.fused import FusedOutput
from ..routing.graphs import GraphedPasses
from ..routing.slots import AdapterSlots
from ..routing.staging import HostBuffers
from ..sets.adapter_set import AdapterSet
from ..sets.stack import AdapterStack
from ..sets.task_index import TaskIndex
from ..stored.cached import CachedBatch, forward_cached
from ..stored.memory_projection import StackedProjection
from ..weights.base_model import BaseModel, create_base
from ..weights.fingerprint import state_fingerprint
from ..weights.spec import ViTSpec
from .preparation import AdapterPreparation
from .slot_passes import SlotPasses

_BASE_ONLY = AdapterSet()  # what a pass without a set runs: no adapters


class MemoryViT(AdapterPreparation, SlotPasses, nn.Module):
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
        # Opt-in: every image's logits bit-identical whatever shares its pass (invariant/), at a cost.
        self.batch_invariant = batch_invariant
        self.invariant_blocks: InvariantBlocks | None = None  # None: the device's defaults
        # The class-token attention and heads of an inference pass: "torch", "triton" or "auto"
        # (Triton on CUDA). Both compute the same numbers (routing/planned.py); tests run Triton on CPU too.
        self.kernels = "auto"
        # The linear layers of an inference pass: "joined" (one product over the base and class-token
        # rows) or "apart" (the base rows' on the base pass's own shape; block/apart.py).
        self.row_gemms = "joined"
        # The torch kernels' joined pass: the last block computes only the rows a head reads (the base
        # head's class token and the class-token rows; block/merged.py ``merged_last_block``), ~5% of a
        # ViT-B/32 pass less, its kept rows through per-image products so that two identical images
        # in one pass still get the same bits. None: on the CPU (thread time, two sittings: R-4.0%,
        # R-2.5% against R+1.9%, R-1.0% whole; docs/design.md §2.1), whole on CUDA.
        self.trim_last_block: bool | None = None
        # On CUDA, inference passes replay CUDA graphs captured per bucketed shape (routing/graphs.py).
        self.cuda_graphs = True
        # Graphed planned passes: the patch embedding's graph is launched before the plan is made, so
        # the device embeds while the host plans. On an H200 (DeiT-Tiny, batch 64) it cut routed 1 and
        # 8 of 1,000 per image by 0.23 and 0.29 ms a pass, same logits (docs/gpu.md).
        self.embed_ahead = True
        self._slots: AdapterSlots | None = None  # built for the device and dtype on first use
        self._graphed_passes: GraphedPasses | None = None
        self._graphs_given = False  # ``use_graphs`` installed a stand-in
        self._host_buffers = HostBuffers()  # host buffers (pinned on CUDA) for the plan's copy to the device
        self.spec = ViTSpec.from_model(base.model, base.arch)  # raises UnsupportedModelError
        self._input_form = (base.model.patch_embed.proj.in_channels, bool(base.model.dynamic_img_size))
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
    # Read several times per pass: kept, and forgotten whenever the module's tensors move or cast.
    @property
    def device(self) -> torch.device:
        return self._placement()[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._placement()[1]

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        placement = self.__dict__.get("_placed")
        if placement is None:
            token = self.base.cls_token
            placement = self.__dict__["_placed"] = (token.device, token.dtype)
        return placement

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), .half(), ...: nn.Module's own
        self.__dict__.pop("_placed", None)
        return super()._apply(fn, recurse)

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

    # -- the fused pass ------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor | CachedBatch,
        adapter_set: AdapterSet | None = None,
        *,
        tasks: Sequence[Collection[str]] | TaskIndex | None = None,
        path: str = "auto",
    ) -> FusedOutput:
        """Images (B, C, H, W) -> base logits and adapter logits, from one pass.

        ``adapter_set``: the snapshot to run (e.g. ``LiveAdapters.current``, read once by the caller);
        None runs the base alone. ``tasks``: None computes every adapter for every image; otherwise
        ``tasks[b]`` names the adapters image b asks for, and only those rows (plus, in extension
        mode, their ancestors') are built: an image pays for the base pass plus what it asks for,
        whatever else the set holds; a ``TaskIndex`` says the same as set positions (what a server
        builds per request, memory_core/sets/task_index.py). ``path``: "auto"/"merged" (class-token rows
        share the base's linear layers) or "split" (kept apart, as training computes them;
        docs/design.md §2.3).

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
        device, dtype = self._placement()  # once for the pass
        self._check_input(x, device)
        path = "split" if path == "split" else "merged"
        plan, base_logits, adapter_logits = self._plan_and_run(x, adapter_set, tasks, path, device, dtype)
        if plan is None:
            return FusedOutput(base_logits, adapter_set, batch=x.shape[0])
        return FusedOutput.of_plan(base_logits, adapter_logits, plan, adapter_set)

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
            z = base.norm(z)  # one norm over every row: a norm of each slice would copy it first
            return z[:, :T], z[:, T:]
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
            return FusedOutput(base_logits, adapter_set)
        stack = adapter_set.stack
        heads = stack.apply_heads(c) if blocks is None else invariant.adapter_heads(stack, c, blocks)
        return FusedOutput.every_image(
            base_logits, dict(zip(adapter_set.names, heads, strict=True)), adapter_set
        )

    def _blocks(self) -> InvariantBlocks:  # the batch-invariant mode's call sizes (invariant/blocks.py)
        return self.invariant_blocks or InvariantBlocks.for_device(self.device, self.dtype)

    def _check_stack(self, stack: AdapterStack) -> None:
        if stack.cls.device != self.device or stack.cls.dtype != self.dtype:
            # A set prepared before the engine moved (all adapters of a stack share one device/dtype).
            raise AdapterShapeError(
                f"these adapters were prepared for {stack.cls.device}/{stack.cls.dtype}, the engine runs "
                f"{self.device}/{self.dtype}: prepare them with this engine (LiveAdapters.move_to moves an "
                "engine and re-prepares its live adapters)",
                field="name",
            )

    def _check_input(self, x: Tensor, device: torch.device | None = None) -> None:
        """``device``: the engine's, when the caller has read it."""
        in_chans, dynamic = self._input_form
        if x.ndim != 4 or x.shape[1] != in_chans:
            raise InputError(f"expected images (B, {in_chans}, H, W), got shape {tuple(x.shape)}")
        if not dynamic and tuple(x.shape[2:]) != self.spec.img_size:
            raise InputError(
                f"expected {self.spec.img_size[0]}x{self.spec.img_size[1]} images for {self.spec.arch}, "
                f"got {x.shape[2]}x{x.shape[3]}"
            )
        device = self.device if device is None else device
        if x.device != device:
            raise InputError(f"images are on {x.device} but the model is on {device}")
