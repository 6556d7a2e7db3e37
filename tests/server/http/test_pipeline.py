"""The /classify request side's response (server/http/pipeline.py ``respond``), without HTTP: built from one
answer, each task's top k by its own class count, its labels, its logits when asked; and its JSON
(``respond_json``) byte for byte FastAPI's."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter

from memvit.memory_core import MemoryViT
from memvit.server.errors import BrokenImageError
from memvit.server.http.pipeline import ClassifyPipeline, respond, respond_json
from memvit.server.http.schemas import ClassifyResponse
from memvit.server.inference.answers import Answer, BatchAnswers, Want
from memvit.server.inference.device_decode import Encoded, JpegCheck
from memvit.server.inference.images import ImageDecoder
from tests.conftest import random_adapter, tiny_engine
from tests.server.inference.test_device_decode import jpeg, photo


def test_the_response_is_built_from_one_answer() -> None:
    engine = tiny_engine()
    adapters = engine.prepare_set(
        [random_adapter("a", engine, classes=3), random_adapter("b", engine, classes=9)]
    )
    out = engine(torch.randn(2, 3, 32, 32), adapters)
    batch = BatchAnswers(out, engine.labels, [Want(0, 2, 5, True)])
    batch.wait()
    answer = batch.cut(Want(0, 2, 5, True), ["a", "base", "b"], version=4, registered=2)
    response = respond(answer, ["x", "y"], top_k=5, logits=True)
    assert response.tasks == ["a", "base", "b"]
    assert (response.registry.version, response.registry.adapters) == (4, 2)
    image = response.results[1]
    assert image.image == "y" and list(image.tasks) == ["a", "base", "b"]
    assert len(image.tasks["a"].predictions) == 3  # the task's 3 classes, though 5 were asked for
    assert len(image.tasks["b"].predictions) == 5
    assert image.tasks["a"].logits == pytest.approx(out.adapters["a"][1].tolist())
    top = out.adapters["b"][1].softmax(-1).topk(5)
    predicted = image.tasks["b"].predictions
    assert [p.index for p in predicted] == top.indices.tolist()
    assert [p.probability for p in predicted] == pytest.approx(top.values.tolist())
    labels = adapters["b"].weights.labels
    expected = [labels[j] if labels else f"class_{j}" for j in top.indices.tolist()]
    assert [p.label for p in predicted] == expected
    lean = respond(answer, ["x", "y"], top_k=1, logits=False)
    assert lean.results[0].tasks["base"].logits is None and len(lean.results[0].tasks["b"].predictions) == 1
    assert lean.model_dump_json()  # serialises as the response model says


RESPONSE = TypeAdapter(ClassifyResponse)


@pytest.mark.parametrize("top_k, logits", [(1, False), (5, True), (20, False)])
def test_the_json_is_fastapis_byte_for_byte(top_k: int, logits: bool) -> None:
    """``respond_json`` writes what FastAPI writes for ``respond``'s model: floats of every size
    (tiny probabilities print as 1e-5, not 1e-05), labels that need escaping, names beyond ASCII,
    tasks with fewer classes than asked, the logits or null."""
    rng = np.random.default_rng(0)
    n, tasks = 3, ("base", "a", "b")
    classes = np.array([10, 3, 12])
    probs = rng.random((n, 3, 12), dtype=np.float32) * np.float32(10.0) ** rng.integers(-12, 1, (n, 3, 12))
    probs[0, 0, :3] = [1.0, 0.0, 1e-5]
    index = rng.integers(0, 3, (n, 3, 12))
    raw = rng.standard_normal((n, 3, 12), dtype=np.float32) * np.float32(1e6)
    labels = (None, ("ünï", 'quo"te', "back\\slash\n"), tuple(f"c{i}" for i in range(5)))
    answer = Answer(tasks, classes, probs, index, raw, labels, version=7, registered=2**40)
    names = ["x.jpg", "名前.jpg", 'a "b"']
    expected = RESPONSE.dump_json(respond(answer, names, top_k=top_k, logits=logits), by_alias=True)
    assert respond_json(answer, names, top_k=top_k, logits=logits) == expected


@pytest.mark.parametrize("check_inline", [False, True])
def test_jpeg_checks_on_the_event_loop_answer_as_the_pool_does(tiny_weights, check_inline: bool) -> None:
    """``check_inline`` (an API process's device path): JPEGs are checked without a worker, anything
    else is decoded by one; each image's result or 4xx in the images' order, as through the pool."""
    cpu = ImageDecoder(MemoryViT.from_timm(weights=tiny_weights), max_bytes=4_000_000, max_pixels=4_000_000)
    pool = ThreadPoolExecutor(1)
    submitted = []

    class Counting:  # the pool, counting what it is given
        def submit(self, fn, *args):
            submitted.append(args)
            return pool.submit(fn, *args)

    pipeline = ClassifyPipeline(
        None, JpegCheck(cpu), Counting(), max_image_bytes=4_000_000, stack=False, check_inline=check_inline
    )
    png = io.BytesIO()
    photo(1, (40, 30)).save(png, "PNG")
    blobs = [jpeg(photo(0)), png.getvalue(), jpeg(photo(2))]
    items = asyncio.run(pipeline.decode(blobs, ["a", "b", "c"]))
    assert isinstance(items[0], Encoded) and isinstance(items[2], Encoded) and items[2].name == "c"
    assert torch.equal(items[1], cpu(blobs[1]))  # the PNG decoded the CPU way, by a worker
    assert len(submitted) == (1 if check_inline else 3)
    with pytest.raises(BrokenImageError, match="b:"):  # the first bad image names itself
        asyncio.run(pipeline.decode([blobs[0], b"\xff\xd8\xff broken", b"not an image"], ["a", "b", "c"]))
    pool.shutdown()


@pytest.mark.parametrize("classes", [[10, 3, 12], [12, 12, 12]])
def test_each_tasks_logits_are_its_own_classes(classes: list[int]) -> None:
    """Tasks padded to the widest (converted task by task) or none padded (the array at once): each
    task's logits are its first ``classes[t]`` columns, nothing of the padding."""
    rng = np.random.default_rng(1)
    n, tasks = 2, ("base", "a", "b")
    raw = rng.standard_normal((n, 3, 12), dtype=np.float32)
    probs, index = np.ones((n, 3, 1), dtype=np.float32), np.zeros((n, 3, 1), dtype=np.int64)
    answer = Answer(tasks, np.array(classes), probs, index, raw, (None,) * 3, version=1, registered=2)
    fields = respond(answer, ["x", "y"], top_k=1, logits=True)
    for i, result in enumerate(fields.results):
        for t, task in enumerate(tasks):
            assert result.tasks[task].logits == raw[i, t, : classes[t]].tolist()
