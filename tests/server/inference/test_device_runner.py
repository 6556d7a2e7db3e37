"""The device runner (server/inference/device_runner.py) on CPU: a batch of images decoded on the CPU and
JPEGs for the device decoder gives the plain pass's answers; a broken JPEG fails its image alone; a pass
that runs out of device memory (the error injected) is split until it fits, and an image that never
fits answers 503, while the rest are answered."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from memvit.memory_core import MemoryViT
from memvit.server.errors import BrokenImageError, DeviceMemoryError
from memvit.server.inference.answers import Want
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.device_runner import DeviceRunner
from memvit.server.inference.images import ImageDecoder
from tests.conftest import TOL, max_diff, random_adapter
from tests.server.inference.test_device_decode import broken_jpeg, jpeg, photo


@pytest.fixture(scope="module")
def setup(tiny_weights):
    engine = MemoryViT.from_timm(weights=tiny_weights)
    cpu = ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000)
    loaded = engine.prepare_set([random_adapter(f"a{i}", engine, m=i) for i in range(3)])
    return engine, cpu, DeviceDecoder(cpu, "cpu"), loaded


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def uploads() -> list[bytes]:
    return [jpeg(photo(0)), png(photo(1)), jpeg(photo(2).convert("L")), png(photo(3)), jpeg(photo(4))]


def test_a_mixed_batch_gives_the_plain_pass(setup) -> None:
    engine, cpu, device, loaded = setup
    blobs = uploads()
    items = [device.prepare(b, f"i{k}") for k, b in enumerate(blobs)]
    assert [type(i).__name__ for i in items] == ["Encoded", "Tensor", "Encoded", "Tensor", "Encoded"]
    tasks = [["a0"], ["a1", "a2"], [], ["a0"], ["a2"]]
    ran = DeviceRunner(engine, device).run(items, loaded, tasks, [Want(0, 5, 3, True)])
    expected = engine(torch.stack([cpu(b) for b in blobs]), loaded, tasks=tasks)
    base = ran.cut(Want(0, 5, 3, True), ["base"], 1, 3).task_logits(0)
    assert max_diff(torch.from_numpy(base), expected.base) <= 0.05  # the device decoder's input: within 2/255
    part = ran.cut(Want(1, 2, 3, True), ["a1", "a2"], 1, 3)  # one request's share
    for t, task in enumerate(part.tasks):
        assert max_diff(torch.from_numpy(part.task_logits(t)), expected.adapters[task][:1]) <= 0.05
    assert set(ran.seconds) >= {"decode", "pass"}


def test_a_broken_jpeg_fails_its_request_alone(setup) -> None:
    engine, _, device, loaded = setup
    items = [
        device.prepare(jpeg(photo(0)), "ok"),
        device.prepare(broken_jpeg(), "bad"),
        device.prepare(jpeg(photo(1)), "ok2"),
    ]
    ran = DeviceRunner(engine, device).run(items, loaded, None, [Want(0, 2, 1, False), Want(2, 3, 1, False)])
    with pytest.raises(BrokenImageError, match="bad"):
        ran.cut(Want(0, 2, 1, False), None, 1, 3)  # the request holding the broken image
    assert len(ran.cut(Want(2, 3, 1, False), None, 1, 3)) == 1


def test_running_out_of_device_memory_splits_the_batch(setup, monkeypatch) -> None:
    engine, cpu, _, loaded = setup
    images = [cpu(b) for b in uploads()]
    expected = engine(torch.stack(images), loaded)
    runs: list[int] = []
    real = MemoryViT.forward

    def small_device(self, x, *args, **kwargs):  # any pass over 2 images runs out of memory
        runs.append(x.shape[0])
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(MemoryViT, "forward", small_device)
    ran = DeviceRunner(engine).run(images, loaded, None, [Want(0, 5, 1, True)])
    assert runs == [5, 2, 3, 1, 2]  # halves, then halves of what still did not fit
    answer = ran.cut(Want(0, 5, 1, True), None, 1, 3)  # one request across the three parts
    for t, task in enumerate(answer.tasks):
        assert max_diff(torch.from_numpy(answer.task_logits(t)), expected.logits()[task]) <= TOL


def test_an_image_that_never_fits_answers_503_and_the_others_are_answered(setup, monkeypatch) -> None:
    engine, cpu, _, loaded = setup
    images = [cpu(b) for b in uploads()]
    real = MemoryViT.forward

    def image_two_never_fits(self, x, *args, **kwargs):
        if any(torch.equal(row, images[2]) for row in x):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(MemoryViT, "forward", image_two_never_fits)
    wants = [Want(0, 2, 1, False), Want(2, 3, 1, False), Want(3, 5, 1, False)]
    ran = DeviceRunner(engine).run(images, loaded, None, wants)
    with pytest.raises(DeviceMemoryError) as refused:
        ran.cut(wants[1], None, 1, 3)
    assert refused.value.status == 503 and refused.value.headers() == {"Retry-After": "1"}
    assert len(ran.cut(wants[0], None, 1, 3)) == 2 and len(ran.cut(wants[2], None, 1, 3)) == 2


def test_each_decode_lane_has_its_own_decoder_and_the_same_answers(setup) -> None:
    """Two decode threads (``lanes=2``): the second lane's decoder is the first's twin (its own
    preprocessing, the same barrier setting) and decodes a mixed batch to the same bits."""
    engine, _, device, _ = setup
    device.barrier = False  # a setting the twin must copy
    try:
        runner = DeviceRunner(engine, device, lanes=2)
    finally:
        device.barrier = True
    first, second = (lane.decoder for lane in runner.lanes)
    assert first is device and second is not device and second.barrier is False
    assert second.preprocess is not device.preprocess and second.cpu is device.cpu
    items = [device.prepare(b, f"i{k}") for k, b in enumerate(uploads())]
    one, two = runner.decode(items, 0), runner.decode(items, 1)
    assert torch.equal(one.x, two.x) and one.failed == two.failed == {}
    with pytest.raises(ValueError, match="lanes"):
        DeviceRunner(engine, device, lanes=0)
