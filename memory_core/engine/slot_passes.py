"""The inference pass of ``MemoryViT``: a plan and images -> logits, run on the device from the
plan and the slot pools (routing/planned.py), in the batch-invariant mode when it is on
(invariant/planned.py), and replayed as a CUDA graph per bucketed shape on CUDA (routing/graphs.py).

``MemoryViT`` inherits this, as it does ``AdapterPreparation``; ``MemoryViT.forward`` plans the pass
and calls ``run_plan``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor

from ..invariant import mode as invariant
from ..invariant import planned as invariant_planned
from ..invariant.blocks import InvariantBlocks
from ..routing import triton_kernels
from ..routing.graphs import GraphedPasses, bucket_images, bucket_rows
from ..routing.plan import PassPlan, PlanTensors
from ..routing.planned import planned_forward
from ..routing.planner import asks_nothing, plan_pass
from ..routing.slots import AdapterSlots
from ..routing.staging import HostBuffers
from ..sets.adapter_set import AdapterSet
from ..weights.spec import ViTSpec


class SlotPasses:
    """``run_plan`` and what it runs on: the engine's slots, its kernels and its CUDA graphs."""

    # What it reads of the engine (memory_core/engine/model.py).
    base: VisionTransformer
    spec: ViTSpec
    device: torch.device
    dtype: torch.dtype
    batch_invariant: bool
    kernels: str
    row_gemms: str
    trim_last_block: bool | None
    cuda_graphs: bool
    embed_ahead: bool
    _slots: AdapterSlots | None
    _graphed_passes: GraphedPasses | None
    _graphs_given: bool
    _host_buffers: HostBuffers

    embed: Callable[[Tensor], Tensor]
    _blocks: Callable[[], InvariantBlocks]
    _placement: Callable[[], tuple[torch.device, torch.dtype]]

    def plan_and_run(
        self, x: Tensor, adapter_set: AdapterSet, tasks, *, path: str = "merged"
    ) -> tuple[PassPlan | None, Tensor, Tensor | None]:
        """Plan the pass (routing/planner.py: None when nobody asked for an adapter) and run it:
        the plan, base logits and adapter logits (``run_plan``). With ``embed_ahead`` (graphed, the
        default mode, merged) the patch embedding's graph is launched first, so that the device
        embeds the images while the host plans; the pass's graph then starts from its tokens."""
        return self._plan_and_run(x, adapter_set, tasks, path, *self._placement())

    def _plan_and_run(
        self, x: Tensor, adapter_set: AdapterSet, tasks, path: str, device: torch.device, dtype: torch.dtype
    ) -> tuple[PassPlan | None, Tensor, Tensor | None]:
        """``plan_and_run`` on the engine's ``device`` and ``dtype``, read once by the caller for the
        pass (each read is a property call: a pass made a dozen of them on the host)."""
        graphed = self._graphed_on(device)
        slots = self._slots_on(device, dtype)

        def plan_now() -> PassPlan | None:
            return plan_pass(
                adapter_set,
                slots,
                tasks,
                x.shape[0],
                images=bucket_images if graphed else None,
                rows=bucket_rows if graphed else None,
                pad_outputs=graphed,
                buffers=self._graphs().buffers if graphed else None,
            )

        ahead = graphed and self.embed_ahead and path == "merged" and not self.batch_invariant
        # Nobody asking for an adapter is the base pass: one graph, the one a base-only call replays.
        if not ahead or len(adapter_set) == 0 or asks_nothing(tasks):
            plan = plan_now()
            return plan, *self._run_plan(x, plan, path, device, graphed)

        def tokens_pass(tokens: Tensor, tensors: PlanTensors | None, plan: PassPlan | None):
            return self._device_pass(tokens, tensors, plan, path, embedded=True)

        def embed_pass(images: Tensor, tensors: PlanTensors | None, plan: PassPlan | None):
            return self.embed(images), None

        key = (self.resolved_kernels, path, self.row_gemms, self.resolved_trim)
        return self._graphs().run_ahead(x, key, embed_pass, plan_now, tokens_pass)

    def run_plan(
        self, x: Tensor, plan: PassPlan | None, *, path: str = "merged"
    ) -> tuple[Tensor, Tensor | None]:
        """The device part of a pass: images and a plan -> base logits (B', C_0) and the adapter logits
        of the plan's output rows (routing/planned.py), or None without a plan (the base alone). On CUDA, a
        replay of the pass's graph (routing/graphs.py) unless ``cuda_graphs`` is off; B' is then the graph's
        padded batch (its first B rows are the images'), else B."""

        device = self.device
        return self._run_plan(x, plan, path, device, self._graphed_on(device))

    def _run_plan(
        self, x: Tensor, plan: PassPlan | None, path: str, device: torch.device, graphed: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``run_plan`` on the engine's ``device``, whose ``graphed`` the caller has read."""

        def device_pass(images: Tensor, tensors: PlanTensors | None, plan: PassPlan | None):
            return self._device_pass(images, tensors, plan, path)

        if graphed:
            key = (self.resolved_kernels, path, self.batch_invariant, self.row_gemms, self.resolved_trim)
            return self._graphs().run(x, plan, key, device_pass)
        tensors = None if plan is None else plan.tensors(device, self._host_buffers)
        return device_pass(x, tensors, plan)

    def _device_pass(
        self, x: Tensor, tensors: PlanTensors | None, plan: PassPlan | None, path: str, embedded: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        base = self.base
        blocks = self._blocks() if self.batch_invariant and path == "merged" else None
        if plan is None:
            if blocks is not None:
                x_tokens, _ = invariant.features(base, x.to(self.dtype), None, blocks)
                return invariant.head(base, x_tokens, blocks), None
            return base.forward_head(base.norm(base.blocks(x if embedded else self.embed(x)))), None
        device = self.device  # once: kernels, graphed and trim each follow from it
        kernels = self._kernels_on(device)
        if blocks is not None:
            x = x.to(self.dtype)
            return invariant_planned.planned(
                base, x, tensors, plan.shape, plan.pools, blocks, kernels=kernels
            )
        x = x if embedded else self.embed(x)  # embedded: the tokens of the embedding's own graph
        return planned_forward(
            base,
            x,
            tensors,
            plan.shape,
            plan.pools,
            kernels=kernels,
            path=path,
            gemms=self.row_gemms,
            trim=self._trim_on(device),
            head_run=None if self.graphed else plan.head_run,  # a graph would bake the value in
        )

    @property
    def graphed(self) -> bool:
        """Whether inference passes run as CUDA graphs: on CUDA, while ``cuda_graphs`` is on (or on
        any device once ``use_graphs`` gave a stand-in)."""
        return self._graphed_on(self.device)

    def _graphed_on(self, device: torch.device) -> bool:
        return self.cuda_graphs and (device.type == "cuda" or self._graphs_given)

    def use_graphs(self, passes: GraphedPasses) -> None:
        """Run inference passes through ``passes``: a stand-in that replays nothing lets a benchmark
        measure a graphed pass's host path on a CPU (benchmarks/host_path.py)."""
        self._graphed_passes, self._graphs_given = passes, True

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far by passes: a server compares it around a pass to see a capture
        while serving (server/inference/device_runner.py)."""
        return 0 if self._graphed_passes is None else self._graphed_passes.captures

    @property
    def graph_captures_beside(self) -> int:
        """CUDA graphs captured beside serving (routing/graphs_beside.py)."""
        return 0 if self._graphed_passes is None else self._graphed_passes.captures_beside

    @property
    def eager_passes(self) -> int:
        """Graphed passes run eagerly while their shape's graph was captured beside serving."""
        return 0 if self._graphed_passes is None else self._graphed_passes.eager_passes

    @contextmanager
    def capturing_for_pending_pools(self) -> Iterator[None]:
        """This thread's passes capture their graphs for the slot pools it grew ahead and has not
        published yet (``AdapterSlots.grow_ahead``), while other threads replay the published ones'."""
        if not self.graphed:
            yield
            return
        with self._graphs().for_pending_pools():
            yield

    def first_use_beside(self, schedule: Callable[[Callable[[], None]], None]) -> AbstractContextManager:
        """This thread's graphed passes never wait for a capture: a shape without a graph runs
        eagerly and its capture goes to ``schedule`` (routing/graphs_beside.py)."""
        return self._graphs().first_use_beside(schedule)

    def _graphs(self) -> GraphedPasses:
        if self._graphed_passes is None:
            self._graphed_passes = GraphedPasses(buffers=self._host_buffers)
        return self._graphed_passes

    @property
    def slots(self) -> AdapterSlots:
        """The device slots of the adapters this engine runs (routing/slots.py), for its current device and
        dtype: after a move, new (empty) slots, filled again as passes need them."""
        return self._slots_on(*self._placement())

    def _slots_on(self, device: torch.device, dtype: torch.dtype) -> AdapterSlots:
        slots = self._slots
        if slots is None or slots.device != device or slots.dtype != dtype:
            slots = self._slots = AdapterSlots(self.spec, device, dtype)
        return slots

    @property
    def resolved_trim(self) -> bool:
        """Whether the torch kernels' joined pass trims its last block: ``trim_last_block`` unless
        None, which is on the CPU (where it measured ~6 points of R faster) and off elsewhere."""
        return self._trim_on(self.device)

    def _trim_on(self, device: torch.device) -> bool:
        if self.trim_last_block is not None:
            return self.trim_last_block
        return device.type == "cpu"

    @property
    def resolved_kernels(self) -> str:
        """The class-token attention and heads' implementation (routing/planned.py): ``kernels``
        unless "auto", which is Triton on CUDA (when installed) and torch elsewhere."""
        return self._kernels_on(self.device)

    def _kernels_on(self, device: torch.device) -> str:
        if self.kernels != "auto":
            return self.kernels
        return "triton" if device.type == "cuda" and triton_kernels.available() else "torch"
