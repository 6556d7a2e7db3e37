"""JPEGs decoded on a GPU under load give the answers they give alone (``pytest -m cuda``).

The pattern of the public reproduction (pytorch/vision#9606, meta-pytorch/torchcodec#1634): work is
queued on a stream behind a long kernel, the tensors it reads are freed while it is still queued,
and the decoder is called. The caching allocator hands the decoder those freed blocks (they belong
to the stream, and later use of the stream is supposed to be ordered after the queued work), and
nvJPEG's hardware engine writes them without waiting for the stream: the queued work then reads the
next batch's pixels. Here the queued work is what serving queues: the previous batch's resize and
gather on the decoder's stream, and the pass's reads of its output on another stream.

``test_..._under_load_as_alone`` must pass: the decoder synchronises its stream before decoding
(server/inference/device_decode.py). ``test_the_load_corrupts_a_decoder_without_the_barrier`` shows the test
can fail: the same load against the same decoder with the barrier off gives wrong pixels.
"""

from __future__ import annotations

import io

import pytest
import torch

from memvit.memory_core import MemoryViT
from memvit.server.inference.device_decode import DeviceDecoder
from memvit.server.inference.images import ImageDecoder
from tests.server.inference.test_device_decode import LEVELS, photo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]
ROUNDS = 30
SLEEP_CYCLES = 50_000_000  # ~30 ms at GPU clocks: the queued work is still waiting when the next decode runs


def baseline_jpeg(seed: int) -> bytes:
    """640 x 480 baseline JPEG (nvJPEG's hardware path), every one the same size (same blocks)."""
    buffer = io.BytesIO()
    photo(seed, (640, 480)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def decoders(tiny_weights) -> tuple[DeviceDecoder, DeviceDecoder]:
    engine = MemoryViT.from_timm(weights=tiny_weights)
    cpu = ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000)
    return DeviceDecoder(cpu, "cuda"), DeviceDecoder(cpu, "cpu")


def batches(decoder: DeviceDecoder) -> tuple[list, list]:
    first = [decoder.prepare(baseline_jpeg(i), f"a{i}") for i in range(8)]
    second = [decoder.prepare(baseline_jpeg(100 + i), f"b{i}") for i in range(8)]
    return first, second


def alone(decoder: DeviceDecoder, items: list) -> torch.Tensor:
    torch.cuda.synchronize()
    x, failed = decoder.decode_batch(items)
    torch.cuda.synchronize()
    assert not failed
    return x.clone()


def under_load(decoder: DeviceDecoder, first: list, second: list) -> int:
    """Rounds in which a batch decoded under load differs from the same batch decoded alone."""
    expected = alone(decoder, first), alone(decoder, second)
    compute = torch.cuda.Stream()
    corrupted = 0
    for _ in range(ROUNDS):
        with torch.cuda.stream(decoder.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # everything queued after it on the decoder's stream waits
        x, _ = decoder.decode_batch(first)  # its resize and gather queued behind the sleep
        compute.wait_stream(decoder.stream)
        with torch.cuda.stream(compute):  # the pass's reads of this batch, on its own stream
            torch.cuda._sleep(SLEEP_CYCLES)
            sums = x.double().sum(dim=(1, 2, 3))
        x.record_stream(compute)
        del x  # freed while its readers are queued, as a served batch is
        y, _ = decoder.decode_batch(second)  # without the barrier: written into blocks still to be read
        torch.cuda.synchronize()
        wrong = not torch.equal(sums, expected[0].double().sum(dim=(1, 2, 3)))
        corrupted += int(wrong or not torch.equal(y, expected[1]))
    return corrupted


def test_the_gpu_decodes_what_the_cpu_decodes(decoders) -> None:
    cuda, cpu = decoders
    first, _ = batches(cuda)
    on_gpu = alone(cuda, first).cpu()
    on_cpu, _ = cpu.decode_batch(first)
    # nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: a few levels, never a wrong picture
    assert (on_gpu - on_cpu).abs().mean() <= LEVELS
    assert (on_gpu - on_cpu).abs().max() <= 16 * LEVELS


def test_batches_decoded_under_load_are_the_batches_decoded_alone(decoders) -> None:
    cuda, _ = decoders
    assert cuda.barrier
    assert under_load(cuda, *batches(cuda)) == 0


def test_the_load_corrupts_a_decoder_without_the_barrier(decoders) -> None:
    cuda, _ = decoders
    cuda.barrier = False
    try:
        corrupted = under_load(cuda, *batches(cuda))
    finally:
        cuda.barrier = True
    # What the barrier prevents (the test above can fail). On a GPU without a hardware JPEG engine
    # nvJPEG's software path orders correctly, but this decoder's own reuse of its pinned tables still
    # needs the barrier, so the race shows there too.
    gpu = torch.cuda.get_device_name()
    if corrupted == 0:  # a race shows when it shows: seen on an H200 in one run of two
        pytest.skip(f"no corruption without the barrier in {ROUNDS} rounds on {gpu}: no power this time")
