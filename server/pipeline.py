"""POST /classify from uploaded bytes to the response: decode -> batch -> fused pass -> predictions.

One object owns the whole path from checked input (``deps.classify_input``: the image count, and the
tasks against the registry, before anything is decoded) to the response, so that its rules live
together:
- each upload is read with its byte cap and decoded in a bounded thread pool, never on the event loop,
  each key's images taken in turn by the service the key received (``FairPool``), not first come;
  with a device decoder, the pool only checks each upload (caps, bombs, header, orientation) and
  JPEGs are decoded on the model's device with their batch (server/device_decode.py);
- while they decode, the adapters asked for are made resident (loaded from the store if they are
  not) and pinned until the batch has run, so no other request's cold load evicts them;
- the images are announced to the batcher while they decode, so a forming batch waits for them;
- the batch's snapshot answers or refuses the tasks (an adapter removed meanwhile gives a 422 naming
  it, never a wrong or missing answer: server/batching.py);
- the response is built from the one snapshot that computed every logit in it;
- the request's stages (decode, queue, the batch's copy and pass) are timed (server/stages.py);
- what was computed is counted for the key that asked (usage per key and task, server/usage.py;
  bounded metrics, server/metrics.py), whichever protocol asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from fastapi import UploadFile
from torch import Tensor

from memvit.memory_core import BASE_TASK, FusedOutput

from .batching import DynamicBatcher
from .device_decode import DeviceDecoder
from .device_runner import Item
from .edge.body import read_upload
from .errors import ImageTooLargeError, NonFiniteOutputError
from .fair_queue import FairPool
from .images import ImageDecoder
from .metrics import Metrics
from .registry import AdapterRegistry, Pin
from .schemas import ClassifyResponse, ImageResult, Prediction, RegistryInfo, TaskResult
from .stages import current_stages
from .usage import UsageMeter


@dataclass(frozen=True)
class Tenant:
    """Whose request it is: a key's id (``admin``, ``anonymous``) and its weight in the fair queues."""

    id: str = "anonymous"
    weight: float = 1.0


ANONYMOUS = Tenant()


class ClassifyPipeline:
    def __init__(
        self,
        registry: AdapterRegistry,
        decoder: ImageDecoder,
        batcher: DynamicBatcher,
        decode_pool: Executor,
        *,
        max_image_bytes: int,
        decode_order: FairPool | None = None,
        metrics: Metrics | None = None,
        usage: UsageMeter | None = None,
        device_decoder: DeviceDecoder | None = None,
    ) -> None:
        self.registry = registry
        self.engine = registry.engine
        self.decoder = decoder
        self.batcher = batcher
        self.decode_pool = decode_pool
        self.decode_order = decode_order  # each key's images in turn on ``decode_pool``; None: first come
        self.max_image_bytes = max_image_bytes
        self.metrics = metrics
        self.usage = usage
        self.device_decoder = device_decoder  # None: every image decoded on the CPU workers

    async def __call__(
        self,
        uploads: Sequence[UploadFile],
        *,
        tasks: list[str] | None,
        top_k: int,
        logits: bool,
        tenant: Tenant = ANONYMOUS,
    ) -> ClassifyResponse:
        """``tasks``: checked (``deps.classify_input``); None asks for every task."""
        names = [upload.filename or f"image-{i}" for i, upload in enumerate(uploads)]
        stages = current_stages()
        if stages is not None:
            stages.received()  # FastAPI has parsed the multipart body
        out = await self.run(self._uploads(uploads, names, tenant), len(names), tasks, tenant)
        return self.respond(out, names, tasks, top_k=top_k, logits=logits)

    async def run(
        self,
        images: Awaitable[Tensor | Sequence[Item]],
        count: int,
        tasks: list[str] | None,
        tenant: Tenant = ANONYMOUS,
    ) -> FusedOutput:
        """``count`` images (decoding, or already preprocessed) through one batched fused pass, queued
        as ``tenant``'s (its share of the passes by its weight), and counted as its usage.

        Routed: these images pay for the adapters asked for, not for every one resident. Their adapters
        are made resident and pinned while the images decode, and stay pinned until the batch has run.
        The batch's snapshot refuses any of them deleted since the request's tasks were checked."""
        adapters = None if tasks is None else [t for t in tasks if t != BASE_TASK]
        # Unfiltered (a small registry): every adapter, less any deleted meanwhile or invalid here.
        wanted = self.registry.all_names() if adapters is None else adapters
        pinning = asyncio.ensure_future(self.registry.acquire_async(wanted, optional=adapters is None))

        async def ready() -> Tensor | Sequence[Item]:
            decoded = await images
            await pinning  # resident and pinned before the images are queued
            return decoded

        try:
            out = await self.batcher.run(
                count, ready(), adapters, flow=tenant.id, weight=tenant.weight, stages=current_stages()
            )
        finally:
            await _unpin(pinning)
        computed = [BASE_TASK, *out.adapters]  # what the pass computed for these images, no more
        if self.usage is not None:
            self.usage.record(tenant.id, count, computed)
        if self.metrics is not None:  # per task asked (base too, when asked), and per key
            asked = computed if tasks is None else [t for t in dict.fromkeys(tasks) if t in computed]
            self.metrics.answered(tenant.id, count, asked, rows=count * len(out.adapters))
        return out

    async def _uploads(
        self, uploads: Sequence[UploadFile], names: list[str], tenant: Tenant
    ) -> Tensor | list[Item]:
        """Every upload read, each with its byte cap, then decoded."""
        blobs = []
        limit = self.max_image_bytes
        for upload, name in zip(uploads, names, strict=True):
            too_large = ImageTooLargeError(f"{name}: over the {limit}-byte upload limit", field=name)
            blobs.append(await read_upload(upload, limit, too_large))
        return await self.decode(blobs, names, tenant)

    async def decode(
        self, blobs: Sequence[bytes], names: Sequence[str], tenant: Tenant = ANONYMOUS
    ) -> Tensor | list[Item]:
        """Encoded images decoded in the pool, in ``tenant``'s turn -> (n, C, H, W); with a device
        decoder, one item per image instead: a JPEG checked and left encoded for the device, or
        anything else decoded here."""
        loop = asyncio.get_running_loop()
        decode = self.decoder if self.device_decoder is None else self.device_decoder.prepare
        started = time.perf_counter()

        def one(data: bytes, name: str) -> asyncio.Future[Tensor]:
            if self.decode_order is None:
                return loop.run_in_executor(self.decode_pool, decode, data, name)
            return self.decode_order.submit(tenant.id, tenant.weight, decode, data, name)

        decoded = await asyncio.gather(
            *(one(data, name) for data, name in zip(blobs, names, strict=True)),
            return_exceptions=True,  # wait for all, so no decode is left running unobserved
        )
        stages = current_stages()
        if stages is not None:
            stages.add("decode", time.perf_counter() - started)
        for result in decoded:
            if isinstance(result, BaseException):
                raise result  # the first bad image names itself
        if self.device_decoder is not None:
            return decoded
        return torch.stack(decoded)

    def respond(
        self, out: FusedOutput, names: list[str], wanted: list[str] | None, *, top_k: int, logits: bool
    ) -> ClassifyResponse:
        """Logits of ``len(names)`` images -> the top ``top_k`` labels of each wanted task."""
        adapter_set = out.adapter_set
        task_logits = out.logits()
        per_task = {}
        for task in wanted or list(task_logits):
            values = task_logits[task]  # (n, C)
            labels = self.engine.labels if task == BASE_TASK else adapter_set[task].weights.labels
            if not torch.isfinite(
                values
            ).all():  # refused at registration; float16 serving could still overflow
                raise NonFiniteOutputError(
                    f"task {task!r} produced non-finite logits; not answering with null"
                )
            top = values.softmax(-1).topk(min(top_k, values.shape[-1]), dim=-1)
            per_task[task] = (values, top, labels)
        results = []
        for i, name in enumerate(names):
            answers = {}
            for task, (values, top, task_labels) in per_task.items():
                predictions = [
                    Prediction(label=_label(task_labels, int(j)), index=int(j), probability=float(p))
                    for p, j in zip(top.values[i], top.indices[i], strict=True)
                ]
                answers[task] = TaskResult(
                    predictions=predictions, logits=values[i].tolist() if logits else None
                )
            results.append(ImageResult(image=name, tasks=answers))
        registry = self.registry.info(adapter_set.version)
        info = RegistryInfo(version=registry.version, adapters=registry.adapters)
        return ClassifyResponse(registry=info, tasks=list(per_task), results=results)


async def _unpin(pinning: asyncio.Future[Pin]) -> None:
    """Release a request's pin once its batch has run (or it failed): the load may still be going."""
    if not pinning.done():
        pinning.cancel()  # acquire_async releases what it pinned when cancelled
    with contextlib.suppress(Exception, asyncio.CancelledError):
        (await pinning).release()


def _label(labels: tuple[str, ...] | None, index: int) -> str:
    return labels[index] if labels is not None and index < len(labels) else f"class_{index}"
