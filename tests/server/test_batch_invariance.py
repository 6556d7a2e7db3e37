"""MEMVIT_BATCH_INVARIANT=true through a real server: the same image sent by many clients at once,
batched with others in whatever way the batcher forms, comes back with one logit vector per task."""

from __future__ import annotations

import io
import threading

import httpx
import torch
from PIL import Image

from memvit.adapters.preprocess import eval_transform, to_rgb
from memvit.memory_core import MemoryViT
from memvit.server.settings import Settings
from tests.server.conftest import TOKEN, free_port, running_server

SAME, OTHERS = 24, 8  # clients sending the image under test, and clients sending other images


def _png(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_one_answer_per_image_under_concurrency(tiny_weights, tmp_path, make_bundle) -> None:
    bundles = [make_bundle("short", m=1), make_bundle("long", m=7, classes=9), make_bundle("none", m=0)]
    image = _png(0)
    settings = Settings(
        weights=tiny_weights,
        adapter_store=tmp_path / "store",
        port=free_port(),
        admin_token=TOKEN,
        max_batch=16,
        max_wait_ms=20,
        batch_invariant=True,
    )
    answers: list[dict] = []
    errors: list[str] = []
    start = threading.Barrier(SAME + OTHERS)

    def client(url: str, i: int) -> None:
        mine = i < SAME
        files = [("image", ("x.png", image if mine else _png(i), "image/png"))]
        params: dict = {"logits": True}
        if i % 3 == 1:  # some ask for one task: those batches are routed
            params["tasks"] = "long" if mine else ("short", "none")[i % 2]
        with httpx.Client(base_url=url, timeout=120) as http:
            start.wait()
            for _ in range(2):
                r = http.post("/classify", files=files, params=params)
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text}")
                elif mine:
                    answers.append(r.json()["results"][0]["tasks"])

    with running_server(settings) as url:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for b in bundles:
            assert (
                httpx.post(f"{url}/adapters", files={"bundle": ("b", b.to_bytes())}, headers=auth).status_code
                == 201
            )
        threads = [threading.Thread(target=client, args=(url, i)) for i in range(SAME + OTHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(f"{url}/metrics").text

    assert errors == []
    assert len(answers) == 2 * SAME
    passes = _metric(metrics, "memvit_batch_images_count")
    assert passes < 2 * (SAME + OTHERS)  # requests did share passes: companions varied
    by_task: dict[str, set[tuple[float, ...]]] = {}
    for tasks in answers:
        for name, answer in tasks.items():
            by_task.setdefault(name, set()).add(tuple(answer["logits"]))
    assert sorted(by_task) == ["base", "long", "none", "short"]
    assert {name: len(vectors) for name, vectors in by_task.items()} == dict.fromkeys(by_task, 1)

    # And it is the image's answer alone, in this process: one answer, not one per server.
    engine = MemoryViT.from_timm(weights=str(tiny_weights), batch_invariant=True)
    x = eval_transform(engine)(to_rgb(Image.open(io.BytesIO(image))))[None]
    with torch.inference_mode():
        alone = engine(x, engine.prepare_set([b.weights for b in bundles])).logits()
    for name, vectors in by_task.items():
        assert torch.equal(torch.tensor(next(iter(vectors))), alone[name][0]), name
