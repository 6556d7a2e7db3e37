"""The embedded demo: small, described by its manifest, accurate, and what `memvit serve` serves when
nothing is configured."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from memvit.adapters import attach_bundle, read_bundle
from memvit.adapters.preprocess import eval_transform
from memvit.memory_core import LiveAdapters, MemoryViT
from memvit.server.demo import BASE_WEIGHTS, DEMO_DIR, demo_adapters
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.skipif(
    not BASE_WEIGHTS.is_file(), reason="the demo is not built (python -m benchmarks.build_demo)"
)
MANIFEST = json.loads((DEMO_DIR / "MANIFEST.json").read_text()) if BASE_WEIGHTS.is_file() else {}
FASHION = "/usr/share/datasets/fashion-mnist"


def load_demo() -> LiveAdapters:
    """The demo base with every demo adapter attached."""
    live = LiveAdapters(MemoryViT.from_timm(weights=BASE_WEIGHTS))
    for path in demo_adapters():
        attach_bundle(live, path)
    return live


def test_files_are_small_and_match_the_manifest() -> None:
    files = [BASE_WEIGHTS, *demo_adapters()]
    assert {p.name for p in files} == set(MANIFEST["sizes_bytes"])
    for path in files:
        assert path.stat().st_size == MANIFEST["sizes_bytes"][path.name], f"{path.name} differs from MANIFEST"
    assert sum(p.stat().st_size for p in files) < 5 * 2**20


def test_adapters_are_memory_adapters_of_this_base() -> None:
    live = load_demo()
    engine = live.engine
    assert set(live.current.names) == {"digits", "orientation"}
    for path in demo_adapters():
        bundle = read_bundle(path)
        assert bundle.weights.memory.shape[1] >= 1, "the demo shows memory tokens"
        assert bundle.base_fingerprint == engine.fingerprint
        recorded = MANIFEST[bundle.weights.name]["val_top1"]
        assert bundle.training["val_accuracy"]["top1"] == pytest.approx(recorded)
    assert MANIFEST["base"]["test_accuracy"] > 0.8
    # Well above chance (0.1 and 0.25); the small Fashion-MNIST base limits what frozen features give.
    assert MANIFEST["digits"]["val_top1"] > 0.6 and MANIFEST["orientation"]["val_top1"] > 0.6


def test_metadata_names_datasets_not_build_machine_paths() -> None:
    """The bundles record where their data came from as a dataset and paths relative to the builder's
    (temporary) data root, not that root itself."""
    for path in demo_adapters():
        training = read_bundle(path).training
        data = training["data"]
        assert data["dataset"]
        for key in ("train_dir", "val_dir"):
            assert not Path(data[key]).is_absolute() and ".." not in Path(data[key]).parts, data[key]
        assert training["source"] == "benchmarks/build_demo.py"
        assert "/tmp" not in json.dumps(training)
    assert "/tmp" not in (DEMO_DIR / "MANIFEST.json").read_text()


def test_base_accuracy_reproduces_on_fashion_mnist() -> None:
    from benchmarks.datasets import fashion_mnist_split

    try:
        images, labels = fashion_mnist_split("t10k", root=Path(FASHION))
    except FileNotFoundError:
        pytest.skip(f"Fashion-MNIST not installed ({FASHION}: apt-get install dataset-fashion-mnist)")
    live = load_demo()
    engine, served = live.engine, live.current
    transform = eval_transform(engine)
    # Through the served path: PNG bytes -> the base's own preprocessing -> one fused pass.
    x = torch.stack([transform(Image.fromarray(img).convert("RGB")) for img in images[:2000]])
    with torch.inference_mode():
        predicted = torch.cat([engine(x[i : i + 500], served).base.argmax(-1) for i in range(0, len(x), 500)])
    accuracy = float((predicted.numpy() == labels[:2000]).mean())
    assert accuracy == pytest.approx(MANIFEST["base"]["test_accuracy"], abs=0.03)


@pytest.fixture(scope="module")
def demo_servers(tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """``memvit serve`` with nothing configured, for each of the two tests below, each on its own new
    store, loading at once (two imports of torch on two cores: about one start's time, not two). Each
    test waits for its own."""
    servers = {
        test: ServerProcess(None, tmp_path_factory.mktemp("demo") / "store").spawn()
        for test in ("serve", "delete")
    }
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_serve_with_nothing_configured_serves_the_demo(demo_servers) -> None:
    server = demo_servers["serve"].wait_ready(120)
    store = Path(server.env["MEMVIT_ADAPTER_STORE"])
    try:
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        listed = httpx.get(f"{server.url}/adapters").json()
        assert [a["name"] for a in listed["adapters"]] == ["digits", "orientation"]
        # The empty store was seeded with the demo's bundles (through the journal, as registrations).
        seeded = (store / "bundles").glob("*/*.safetensors")
        assert sorted(p.parent.name for p in seeded) == [p.stem for p in demo_adapters()]
        assert listed["registry"] == {"version": 2, "adapters": 2}
        png = io.BytesIO()
        Image.fromarray(np.tri(28, dtype=np.uint8) * 255).save(png, format="PNG")
        r = httpx.post(f"{server.url}/classify", files={"image": ("x.png", png.getvalue())})
        assert r.status_code == 200, r.text
        tasks = r.json()["results"][0]["tasks"]
        assert set(tasks) == {"base", "digits", "orientation"}
        assert {p["label"] for p in tasks["digits"]["predictions"]} <= {str(d) for d in range(10)}
    finally:
        server.stop()


def test_deleted_demo_adapters_stay_deleted_across_restarts(demo_servers) -> None:
    """An empty store is seeded once in its life: deleting the demo adapters is never undone."""
    server = demo_servers["delete"].wait_ready(120)
    store = Path(server.env["MEMVIT_ADAPTER_STORE"])
    try:
        for name in ("digits", "orientation"):
            assert httpx.delete(f"{server.url}/adapters/{name}").status_code == 200
    finally:
        server.stop()
    assert list(store.rglob("*.safetensors")) == []  # deleted, and their objects collected
    # A restart, and another replica starting on the same empty store: a start that leaves the
    # store's bytes as it found them is what any later start would read again, so a second start
    # is needed only when the first one wrote something (measured: it writes nothing, ~8 s saved).
    for _ in range(2):
        found = _contents(store)
        server = ServerProcess(None, store).start()
        try:
            assert httpx.get(f"{server.url}/adapters").json()["adapters"] == []
        finally:
            server.stop()
        if _contents(store) == found:
            break
    assert list(store.rglob("*.safetensors")) == []  # deleted, and their objects collected


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
