"""MemoryViT: a frozen timm ViT plus any number of memory adapters, in one fused forward pass.

    forward(x) = forward_head(*forward_features(x, stack))

``forward_features`` runs the base tokens through every block exactly as timm does, and the K
adapter class tokens alongside them (``attention.py``); ``forward_head`` applies the base's own head
to the base tokens and each adapter's head to its class token. The live adapters are an immutable
``AdapterSet``; ``install`` is the one way to change them (under the engine's one write lock), and
readers never lock: a pass reads the reference once and keeps that snapshot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import resolve_data_config
from torch import Tensor, nn

from .adapter import BASE_TASK, AdapterWeights
from .adapter_set import AdapterSet, AdapterStack, PreparedAdapter
from .attention import merged_block, project_memory, split_block
from .base_model import BaseModel, create_base
from .errors import AdapterShapeError, InputError
from .fingerprint import state_fingerprint
from .routing import Route, build_route
from .spec import ViTSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedOutput:
    """Logits of one fused pass, and the adapter set that produced them.

    Without routing every task answers every image: ``adapters[name]`` is (B, C_k) and ``images`` is
    None. A routed pass (``MemoryViT.forward(..., tasks=...)``) answers only what each image asked:
    ``adapters[name]`` is (n, C_k) for the n images in ``images[name]`` (ascending indices).
    """

    base: Tensor  # (B, C_0): the base model's own task
    adapters: dict[str, Tensor]  # name -> (B, C_k), or (n, C_k) when routed; in the set's order
    adapter_set: AdapterSet
    images: dict[str, Tensor] | None = None  # routed: name -> (n,) image indices

    def __len__(self) -> int:
        return self.base.shape[0]

    def __getitem__(self, rows: slice) -> FusedOutput:
        """The same tasks for a slice of the images (e.g. one request's share of a batch)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"FusedOutput takes a contiguous slice of images, got {rows!r}")
        if self.images is None:
            return FusedOutput(
                base=self.base[rows],
                adapters={name: t[rows] for name, t in self.adapters.items()},
                adapter_set=self.adapter_set,
            )
        start, stop, _ = rows.indices(len(self))
        adapters, images = {}, {}
        for name, who in self.images.items():
            keep = (who >= start) & (who < stop)
            if bool(keep.any()):
                adapters[name], images[name] = self.adapters[name][keep], who[keep] - start
        return FusedOutput(self.base[rows], adapters, self.adapter_set, images=images)

    def logits(self) -> dict[str, Tensor]:
        """Every task's logits by task name, the base task first."""
        return {BASE_TASK: self.base, **self.adapters}

    def to(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> FusedOutput:
        return FusedOutput(
            base=self.base.to(device, dtype),
            adapters={name: t.to(device, dtype) for name, t in self.adapters.items()},
            adapter_set=self.adapter_set,
            images=None if self.images is None else {n: i.to(device) for n, i in self.images.items()},
        )


class MemoryViT(nn.Module):
    """A frozen timm ViT that serves its own task and every loaded adapter in one pass."""

    def __init__(
        self,
        base: BaseModel,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.spec = ViTSpec.from_model(base.model, base.arch)  # raises UnsupportedModelError
        self.base = base.model.eval().requires_grad_(False)
        self.labels = base.labels
        self.source = base.source
        self._data_config_overrides = dict(base.data_config or {})
        # Fingerprint the weights as given, before any cast, so it names the weights, not the dtype.
        self.fingerprint = state_fingerprint(self.base.state_dict())
        self._write_lock = threading.RLock()
        self._adapters = AdapterSet()
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
        return cls(base, device=device, dtype=dtype)

    # -- device, dtype, mode -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.base.cls_token.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.cls_token.dtype

    def _apply(self, fn: Any, recurse: bool = True) -> MemoryViT:
        # .to()/.cuda()/.half() land here: move the base, then re-prepare the adapters on it.
        super()._apply(fn, recurse)
        if getattr(self, "_adapters", None) is not None and len(self._adapters):
            with self.exclusive() as live:
                self.install(AdapterSet(tuple(self.prepare(a.weights) for a in live)))
        return self

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

    # -- adapters ------------------------------------------------------------------------------
    @property
    def adapters(self) -> AdapterSet:
        """The live adapter set. Hold on to it to run several passes on the same snapshot."""
        return self._adapters

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
            keys, values = self.project_memory(weights.memory.to(**like), weights.memory_norm)
            return self._prepared(weights, keys, values)

    def prepare_many(self, weights: Sequence[AdapterWeights], *, chunk: int = 512) -> list[PreparedAdapter]:
        """``prepare`` for many adapters (start-up with thousands of bundles), in the same order.

        Memory tokens are projected independently of one another, so the memories of many adapters
        go through each block's norm and qkv together: one matmul per layer and chunk instead of
        one per adapter and layer, which is what dominates preparing small adapters one by one.
        """
        if any(w.requires_grad for w in weights):
            return [self.prepare(w) for w in weights]
        for w in weights:
            w.check_fits(self.spec)
        like = {"device": self.device, "dtype": self.dtype}
        prepared: list[PreparedAdapter | None] = [None] * len(weights)
        with torch.no_grad():
            for start in range(0, len(weights), chunk):
                group = range(start, min(start + chunk, len(weights)))
                for norm in sorted({weights[i].memory_norm for i in group}):
                    members = [i for i in group if weights[i].memory_norm == norm]
                    sizes = [weights[i].num_memory for i in members]
                    memory = torch.cat([weights[i].memory.to(**like) for i in members], dim=1)  # (L, Σm, D)
                    keys, values = self.project_memory(memory, norm)  # (L, H, Σm, d)
                    # Own copies: a view would keep the whole chunk alive after its neighbours are gone.
                    split_k = [k.clone() for k in keys.split(sizes, dim=2)]
                    split_v = [v.clone() for v in values.split(sizes, dim=2)]
                    for i, k, v in zip(members, split_k, split_v, strict=True):
                        prepared[i] = self._prepared(weights[i], k, v)
        return prepared  # type: ignore[return-value]  # every slot is filled above

    def _prepared(self, weights: AdapterWeights, keys: Tensor, values: Tensor) -> PreparedAdapter:
        like = {"device": self.device, "dtype": self.dtype}
        return PreparedAdapter(
            name=weights.name,
            parent=weights.parent,
            weights=weights,
            cls=weights.cls_token.to(**like) + self.class_position(),
            memory_keys=keys,
            memory_values=values,
            head_weight=weights.head_weight.to(**like),
            head_bias=weights.head_bias.to(**like),
        )

    def project_memory(self, memory: Tensor, memory_norm: str) -> tuple[Tensor, Tensor]:
        """Memory (L, m, D) -> keys and values (L, H, m, d) through each block's norm1/qkv."""
        L, m, _ = memory.shape
        if m == 0:
            empty = memory.new_zeros(L, self.spec.num_heads, 0, self.spec.head_dim)
            return empty, empty
        pairs = [project_memory(block, memory[i], memory_norm) for i, block in enumerate(self.base.blocks)]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    @contextmanager
    def exclusive(self) -> Iterator[AdapterSet]:
        """Hold the write lock and yield the live set: read, derive, persist and ``install`` atomically.

        The one lock that orders every change to the live set (the adapter service runs its store
        writes under it too). Re-entrant. Passes never take it.
        """
        with self._write_lock:
            yield self._adapters

    def install(self, adapter_set: AdapterSet) -> AdapterSet:
        """Make ``adapter_set`` live: the one way the live set changes. Returns it.

        Its adapters must have been prepared by this engine, on its current device and dtype. Passes
        in flight keep the set they started with; every later pass sees the new one.
        """
        device, dtype = self.device, self.dtype  # once: module attribute lookups cost ~1 µs each
        for adapter in adapter_set:
            if adapter.cls.device != device or adapter.cls.dtype != dtype:
                raise AdapterShapeError(
                    f"adapter {adapter.name!r} was prepared for {adapter.cls.device}/{adapter.cls.dtype}, "
                    f"the engine runs {device}/{dtype}; prepare it with this engine",
                    field="name",
                )
        with self._write_lock:
            self._adapters = adapter_set  # one reference assignment
        names = adapter_set.names
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        log.info("adapter set v%d live: [%s]", adapter_set.version, shown)
        return adapter_set

    # Conveniences over ``install``: each derives the new set from the live one under the lock.
    def add_adapter(self, weights: AdapterWeights, *, replace: bool = False) -> AdapterSet:
        """Make ``weights`` live. Returns the new set; on any error the live set is unchanged."""
        prepared = self.prepare(weights)
        with self.exclusive() as live:
            return self.install(live.with_adapter(prepared, replace=replace))

    def remove_adapter(self, name: str) -> AdapterSet:
        with self.exclusive() as live:
            return self.install(live.without(name))

    def set_adapters(self, adapters: Iterable[AdapterWeights]) -> AdapterSet:
        """Replace the whole live set at once (parents must come before their extensions)."""
        return self.install(AdapterSet(tuple(self.prepare_many(list(adapters)))))

    # -- the fused pass ------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        adapter_set: AdapterSet | None = None,
        *,
        tasks: Sequence[Collection[str]] | None = None,
        path: str = "auto",
    ) -> FusedOutput:
        """Images (B, C, H, W) -> base logits and adapter logits, from one pass.

        ``tasks``: None computes every adapter for every image; otherwise ``tasks[b]`` names the
        adapters image b asks for, and only those rows (plus, in extension mode, their ancestors')
        are built: an image pays for the base pass plus what it asks for, whatever else is loaded.
        """
        adapter_set = self._adapters if adapter_set is None else adapter_set  # read the reference once
        if tasks is None:
            x_tokens, c_tokens = self.forward_features(x, adapter_set.stack, path=path)
            return self.forward_head(x_tokens, c_tokens, adapter_set)
        route = build_route(adapter_set, tasks, x.shape[0])
        x_tokens, c_tokens = self.forward_features(x, route, path=path)
        if route is None:  # nobody asked for an adapter: a base-only pass
            return FusedOutput(self.base.forward_head(x_tokens), {}, adapter_set, images={})
        return self.forward_head(x_tokens, c_tokens, adapter_set, route)

    def forward_features(
        self, x: Tensor, stack: AdapterStack | Route | None, *, path: str = "auto"
    ) -> tuple[Tensor, Tensor | None]:
        """Images -> final-normed base tokens (B, T, D) and adapter class tokens (B, K, D) or None.

        ``stack``: every adapter for every image (an ``AdapterStack``), or the rows a ``Route`` picked
        per image (then K is its R). ``path``: "merged" runs base and class-token rows through each
        linear layer together (fastest for inference); "split" keeps them apart so that autograd
        records only the class-token rows (training, docs/design.md §2.3); "auto" picks split exactly
        when gradients will flow into the stack.
        """
        self._check_input(x)
        base = self.base
        x = x.to(self.dtype)
        x = base.norm_pre(base.patch_drop(base._pos_embed(base.patch_embed(x))))  # (B, T, D)
        if stack is None:
            return base.norm(base.blocks(x)), None
        cls = stack.cls if stack.cls.ndim == 3 else stack.cls.expand(x.shape[0], -1, -1)
        c = base.norm_pre(cls)  # (B, K, D)
        if path == "auto":
            path = "split" if torch.is_grad_enabled() and stack.requires_grad else "merged"
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

    def forward_head(
        self, x: Tensor, c: Tensor | None, adapter_set: AdapterSet, route: Route | None = None
    ) -> FusedOutput:
        """Final tokens -> logits. With a ``route``, only the rows asked for meet a head (ancestors
        computed for an extension do not), and ``images`` says which images each task answers."""
        base_logits = self.base.forward_head(x)
        logits: dict[str, Tensor] = {}
        if c is None:
            return FusedOutput(base_logits, logits, adapter_set)
        if route is None:
            heads = adapter_set.stack.apply_heads(c)  # (B, C_k) each
            logits = dict(zip(adapter_set.names, heads, strict=True))
            return FusedOutput(base_logits, logits, adapter_set)
        images: dict[str, Tensor] = {}
        for name, (weight, bias), who, rows in route.outputs:
            logits[name] = F.linear(c[who, rows], weight, bias)  # (n, C_k): the n images asking
            images[name] = who
        return FusedOutput(base_logits, logits, adapter_set, images=images)

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
