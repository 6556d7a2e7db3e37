"""The device decoder (server/inference/device_decode.py), run on CPU through torchvision's CPU decoder: the
same code a GPU runs through nvJPEG. It must hand the model what the exact CPU path (Pillow) hands it,
within one or two levels of 255, and answer every broken or hostile upload with the same 4xx."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from memvit.memory_core import MemoryViT
from memvit.server.errors import ServiceError
from memvit.server.inference.device_decode import DeviceDecoder, Encoded
from memvit.server.inference.images import ImageDecoder
from tests.conftest import SHARED_DATA

FORMATS = SHARED_DATA / "photos" / "formats"
NATURAL = SHARED_DATA / "photos" / "natural"
# Two levels of 255 in the normalised input (std ~0.225): torchvision's antialiased resize rounds a
# pixel now and then one level off Pillow's, twice where an EXIF rotation changes the order of sums.
LEVELS = 2 / 255 / 0.224


@pytest.fixture(scope="module")
def decoders(tiny_weights) -> tuple[ImageDecoder, DeviceDecoder]:
    engine = MemoryViT.from_timm(weights=tiny_weights)  # 32 x 32 input: every upload is shrunk
    cpu = ImageDecoder(engine, max_bytes=4_000_000, max_pixels=4_000_000)
    return cpu, DeviceDecoder(cpu, "cpu")


def jpeg(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


def photo(seed: int = 0, size: tuple[int, int] = (301, 217)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (size[1] // 8, size[0] // 8, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(noise.numpy()).resize(size, Image.BICUBIC)  # smooth, like a photo


def both(decoders, data: bytes, name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    cpu, device = decoders
    item = device.prepare(data, name)
    assert isinstance(item, Encoded), "a JPEG of RGB or grey goes to the device decoder"
    (out,) = device.decode([item])
    assert isinstance(out, torch.Tensor)
    return out, cpu(data, name)


def test_a_batch_of_jpegs_matches_the_exact_cpu_path(decoders) -> None:
    cpu, device = decoders
    blobs = [jpeg(photo(i, (200 + 37 * i, 150 + 23 * i))) for i in range(5)]
    blobs.append(jpeg(photo(9).convert("L")))  # grey
    items = [device.prepare(b, f"p{i}") for i, b in enumerate(blobs)]
    outs = device.decode(items)
    for blob, out in zip(blobs, outs, strict=True):
        expected = cpu(blob)
        assert out.shape == expected.shape and out.dtype == torch.float32
        assert (out - expected).abs().max() <= LEVELS


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_pillow_does(decoders, orientation: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(photo(3, (240, 160)), exif=exif)
    out, expected = both(decoders, data)
    assert (out - expected).abs().max() <= LEVELS


def test_the_shared_photos_and_format_cases(decoders) -> None:
    if not FORMATS.is_dir():
        pytest.skip(f"the shared photos are absent ({FORMATS})")
    cpu, device = decoders
    on_device, on_cpu = [], []
    for path in sorted([*FORMATS.iterdir(), *NATURAL.glob("*.jpg")]):
        data = path.read_bytes()
        try:
            item = device.prepare(data, path.name)
        except ServiceError as exc:  # the same 4xx the CPU path gives
            with pytest.raises(type(exc), match="damaged or truncated"):
                cpu(data, path.name)
            continue
        if isinstance(item, Encoded):
            on_device.append(path.name)
            (out,) = device.decode([item])
            assert (out - cpu(data, path.name)).abs().max() <= LEVELS, path.name
        else:  # decoded the exact CPU way
            on_cpu.append(path.name)
            assert torch.equal(item, cpu(data, path.name)), path.name
    assert {"hopper_orientation_6.jpg", "hopper_gray.jpg", "frozenpond.mpo"} <= set(on_device)
    assert {"pil_sample_cmyk.jpg", "hopper.png", "flower.webp", "hopper.gif", "hopper.bmp"} <= set(on_cpu)


def broken_jpeg() -> bytes:
    """Markers intact (it goes to the device decoder), Huffman table garbage: both decoders refuse."""
    data = bytearray(jpeg(photo(5)))
    table = data.index(b"\xff\xc4")
    for j in range(table + 5, table + 25):
        data[j] = 0xFF if j % 2 else 0x01
    return bytes(data)


def test_a_file_the_device_decoder_refuses_gets_the_cpu_paths_error_and_the_rest_are_decoded(
    decoders,
) -> None:
    cpu, device = decoders
    good = jpeg(photo(1))
    items = [
        device.prepare(good, "good"),
        device.prepare(broken_jpeg(), "bad"),
        device.prepare(good, "again"),
    ]
    out = device.decode(items)
    with pytest.raises(ServiceError) as expected:
        cpu(broken_jpeg(), "bad")
    assert type(out[1]) is type(expected.value) and str(out[1]) == str(expected.value)
    assert isinstance(out[0], torch.Tensor) and torch.equal(out[0], out[2])
    x, failed = device.decode_batch([items[1]])  # a batch of nothing but a broken file
    assert x.shape == (1, *device.shape) and type(failed[0]) is type(expected.value)


@pytest.mark.parametrize(
    "case",
    ["empty", "truncated jpeg", "not an image", "over the byte cap", "over the pixel cap", "bomb header"],
)
def test_broken_and_hostile_uploads_get_the_cpu_paths_4xx(decoders, case: str) -> None:
    cpu, device = decoders
    whole = jpeg(photo(2, (640, 480)))
    data = {
        "empty": b"",
        "truncated jpeg": whole[: len(whole) * 2 // 3],  # no end marker: the CPU way, which names it
        "not an image": b"%PDF-1.4 not a picture",
        "over the byte cap": whole + b"\0" * 4_000_000,
        "over the pixel cap": jpeg(Image.new("RGB", (2100, 2000))),
        "bomb header": _huge_header(whole),
    }[case]
    with pytest.raises(ServiceError) as on_cpu:
        cpu(data, "upload")
    with pytest.raises(ServiceError) as on_device:
        item = device.prepare(data, "upload")
        (out,) = device.decode([item])
        if isinstance(out, ServiceError):
            raise out
    assert type(on_device.value) is type(on_cpu.value) and on_device.value.status == on_cpu.value.status
    assert 400 <= on_cpu.value.status < 500


def _huge_header(data: bytes) -> bytes:
    """A JPEG whose frame header claims 60000 x 60000 pixels: refused before a byte is decoded."""
    frame = bytearray(data)
    sof = frame.index(b"\xff\xc0")
    frame[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") * 2
    return bytes(frame)


def test_calls_padded_to_a_few_sizes_decode_the_same_inputs(decoders, monkeypatch) -> None:
    """``call_sizes``: the decoder is given each call padded with fillers to the first size that holds
    it (none above the largest); the batch's inputs and refusals are the unpadded call's, bit for bit."""
    import memvit.server.inference.device_decode as module

    cpu, plain = decoders
    padded = DeviceDecoder(cpu, "cpu", (4, 8))
    assert padded.twin().call_sizes == (4, 8)
    given = []
    decode_one = module._DECODE_ON_CPU
    monkeypatch.setattr(module, "_DECODE_ON_CPU", lambda *a: given.append(1) or decode_one(*a))
    blobs = [jpeg(photo(i, (120 + 11 * i, 90 + 7 * i))) for i in range(9)]
    for n, size in ((1, 4), (3, 4), (4, 4), (5, 8), (9, 9)):
        items = [plain.prepare(b, f"p{i}") for i, b in enumerate(blobs[:n])]
        given.clear()
        x, failed = padded.decode_batch(items)
        assert len(given) == size and not failed, n
        given.clear()
        expected, _ = plain.decode_batch(items)
        assert len(given) == n and torch.equal(x, expected), n
    broken = [plain.prepare(blobs[0], "good"), plain.prepare(broken_jpeg(), "bad")]
    (x, failed), (expected, refused) = padded.decode_batch(broken), plain.decode_batch(broken)
    assert torch.equal(x, expected) and list(failed) == list(refused) == [1]
    for sizes in ((8, 4), (0, 4), (4, 4)):
        with pytest.raises(ValueError, match="ascending"):
            DeviceDecoder(cpu, "cpu", sizes)
