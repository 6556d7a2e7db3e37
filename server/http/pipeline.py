"""POST /classify's request side: read, check, answer. What runs the pass is a runner's
(server/inference/runner.py).

One object owns the path from checked input (``deps.classify_input``: the image count, and the tasks
against the registry, before anything is decoded) to the response, the same in one process and in an
API process (only the runner differs: in-process, or across the link to the model process):
- each upload is read with its byte cap and decoded in a bounded thread pool, never on the event loop,
  each key's images taken in turn by the service the key received (``FairPool``), not first come;
  with the device decoder, the pool only checks each upload (caps, bombs, header, orientation) and
  JPEGs are decoded on the model's device with their batch (server/inference/device_decode.py);
- the runner starts before the images are decoded (it pins the adapters and announces the images);
- the response is built from the one ``Answer`` the runner returns (server/inference/answers.py): numbers
  computed for the whole batch at once, cut for this request with one index; here only the response
  objects are built, one Python list per array, not a softmax or a ``.tolist()`` per task;
- the request's stages (receive, decode, and the runner's queue, copy and pass) are timed
  (server/telemetry/stages.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import torch
from fastapi import UploadFile
from pydantic_core import to_json

from ..edge.body import read_upload
from ..errors import ImageTooLargeError
from ..inference.answers import Answer, Labels
from ..inference.device_decode import JpegCheck
from ..inference.device_runner import Item
from ..inference.fair_queue import FairPool
from ..inference.runner import ANONYMOUS, Ask, Images, Runner, Tenant
from ..telemetry.stages import current_stages
from .schemas import ClassifyResponse

__all__ = ["ANONYMOUS", "Ask", "ClassifyPipeline", "Tenant", "respond", "respond_json"]

Decode = Callable[[bytes, str], Item]  # one upload -> its image (C, H, W), or a JPEG left encoded


class ClassifyPipeline:
    """``decode``: what a decode worker does with one upload (``ImageDecoder``, or the device path's
    ``JpegCheck``); ``stack``: whether its images are stacked (every one decoded here)."""

    def __init__(
        self,
        runner: Runner,
        decode: Decode,
        decode_pool: Executor,
        *,
        max_image_bytes: int,
        stack: bool = True,
        decode_order: FairPool | None = None,
        check_inline: bool = False,
    ) -> None:
        self.runner = runner
        self.decoder = decode
        # ``check_inline``: the device path's JPEG checks run on the event loop (JpegCheck.inline, tens
        # of microseconds, no pixels), a worker only for what is decoded here: the hop to a worker
        # and back cost an API process more CPU than the check (benchmarks/RESULTS.md §3.14). Not in
        # one process: there the hop is what lets a forming batch wait for the requests being
        # checked (announced), and without it batches halved and the passes cost more than it saved.
        self.inline = decode.inline if check_inline and isinstance(decode, JpegCheck) else None
        self.decode_pool = decode_pool
        self.stack = stack
        self.decode_order = decode_order  # each key's images in turn on ``decode_pool``; None: first come
        self.max_image_bytes = max_image_bytes

    async def __call__(
        self,
        uploads: Sequence[UploadFile],
        *,
        tasks: list[str] | None,
        top_k: int,
        logits: bool,
        tenant: Tenant = ANONYMOUS,
        as_json: bool = False,
    ) -> ClassifyResponse | bytes:
        """``tasks``: checked (``deps.classify_input``); None asks for every task. ``as_json``: the
        response's JSON as FastAPI would send it (``respond_json``), not its model."""
        names = [upload.filename or f"image-{i}" for i, upload in enumerate(uploads)]
        stages = current_stages()
        if stages is not None:
            stages.received()  # FastAPI has parsed the multipart body
        ask = Ask(len(names), tasks, tenant, top_k=top_k, logits=logits)
        answer = await self.run(ask, self._uploads(uploads, names, tenant))
        return (respond_json if as_json else respond)(answer, names, top_k=top_k, logits=logits)

    async def run(self, ask: Ask, images) -> Answer:
        """The runner's answer, its stages added to the request's."""
        answer = await self.runner.run(ask, images)
        stages = current_stages()
        if stages is not None:  # the request's Server-Timing and stage metrics: the pass's stages too
            for stage, seconds in answer.stages.items():
                stages.add(stage, seconds)
            stages.answered = time.perf_counter()
        return answer

    async def _uploads(self, uploads: Sequence[UploadFile], names: list[str], tenant: Tenant) -> Images:
        """Every upload read, each with its byte cap, then decoded."""
        blobs = []
        limit = self.max_image_bytes
        for upload, name in zip(uploads, names, strict=True):
            too_large = ImageTooLargeError(f"{name}: over the {limit}-byte upload limit", field=name)
            blobs.append(await read_upload(upload, limit, too_large))
        return await self.decode(blobs, names, tenant)

    async def decode(
        self, blobs: Sequence[bytes], names: Sequence[str], tenant: Tenant = ANONYMOUS
    ) -> Images:
        """Encoded images decoded in the pool, in ``tenant``'s turn -> (n, C, H, W); with the device
        decoder, one item per image instead: a JPEG checked and left encoded for the device, or
        anything else decoded here."""
        loop = asyncio.get_running_loop()
        decode, inline = self.decoder, self.inline
        started = time.perf_counter()

        def one(data: bytes, name: str) -> asyncio.Future[Item]:
            if self.decode_order is None:
                return loop.run_in_executor(self.decode_pool, decode, data, name)
            return self.decode_order.submit(tenant.id, tenant.weight, decode, data, name)

        decoded: list[Item | BaseException | None] = [None] * len(blobs)
        pending: dict[int, asyncio.Future[Item]] = {}
        for i, (data, name) in enumerate(zip(blobs, names, strict=True)):
            if inline is not None:  # a JPEG for the device: checked here, no thread hop
                try:
                    decoded[i] = inline(data, name)
                except Exception as exc:  # answered in the images' order, as the pool's would be
                    decoded[i] = exc
                if decoded[i] is not None:
                    continue
            pending[i] = one(data, name)
        if pending:  # wait for all, so no decode is left running unobserved
            done = await asyncio.gather(*pending.values(), return_exceptions=True)
            for i, result in zip(pending, done, strict=True):
                decoded[i] = result
        stages = current_stages()
        if stages is not None:
            stages.add("decode", time.perf_counter() - started)
        for result in decoded:
            if isinstance(result, BaseException):
                raise result  # the first bad image names itself
        return torch.stack(decoded) if self.stack else decoded


def respond(answer: Answer, names: list[str], *, top_k: int, logits: bool) -> ClassifyResponse:
    """An ``Answer`` -> the response model: each image's top ``top_k`` labels of each task it asked
    for (``response_fields``, validated into the models)."""
    return ClassifyResponse.model_validate(response_fields(answer, names, top_k=top_k, logits=logits))


def respond_json(answer: Answer, names: list[str], *, top_k: int, logits: bool) -> bytes:
    """``respond``'s response as FastAPI sends it (pydantic's JSON of ``ClassifyResponse``, by alias),
    byte for byte, from the plain fields in one ``to_json`` call: building the models and serialising
    them cost ~4x the time (tests/server/http/test_pipeline.py compares the two)."""
    return to_json(response_fields(answer, names, top_k=top_k, logits=logits))


def response_fields(answer: Answer, names: list[str], *, top_k: int, logits: bool) -> dict:
    """The response as plain dicts and lists, in ``ClassifyResponse``'s shape. One ``tolist`` per
    array for the whole request (padded logits: ``_logit_lists``); then the per-image, per-task fields."""
    tasks, classes = answer.tasks, answer.classes.tolist()
    probs, index = answer.probs.tolist(), answer.index.tolist()  # (n, T, k) nested lists
    raw = _logit_lists(answer.logits, classes) if logits and answer.logits is not None else None
    keep = [min(top_k, c) for c in classes]
    results = []
    for i, name in enumerate(names):
        answers = {}
        for t, task in enumerate(tasks):
            labels = answer.labels[t]
            predictions = [
                {"label": _label(labels, j), "index": j, "probability": p}
                for p, j in zip(probs[i][t][: keep[t]], index[i][t][: keep[t]], strict=True)
            ]
            values = raw[i][t] if raw is not None else None
            answers[task] = {"predictions": predictions, "logits": values}
        results.append({"image": name, "tasks": answers})
    registry = {"version": answer.version, "adapters": answer.registered}
    return {"registry": registry, "tasks": list(tasks), "results": results}


def _logit_lists(logits: np.ndarray, classes: list[int]) -> list[list[list[float]]]:
    """(n, T) lists of each task's own logits. One ``tolist`` for the array when no task is padded;
    else one per image and task, of its classes only: beside a 1,000-class base, 100-class adapters
    are padded to 1,000, and the whole array's list would convert five times the values (0.12 ms
    against 0.03 for 8 such adapters, a fifth of the request's response)."""
    if all(c == logits.shape[2] for c in classes):
        return logits.tolist()
    return [[row[t, :c].tolist() for t, c in enumerate(classes)] for row in logits]


def _label(labels: Labels, index: int) -> str:
    return labels[index] if labels is not None and index < len(labels) else f"class_{index}"
