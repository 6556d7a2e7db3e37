"""The page at / in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright,
against a real ``memvit serve`` of the embedded demo with an admin token.

It uploads sample images through the file input and checks every task's rendered predictions against
server/demo/samples/README.md, shows an API error, registers an adapter with the token (a wrong token
first), sees it answer, deletes it, and checks the page asked nothing of any other origin.

A second test plays another site's page against the loopback default (no token: management open to
local clients): its form POST is refused, and a DNS-rebinding name gets the Host check's 400.

A full-page screenshot is kept as ``page.png`` in the test's tmp dir, and copied into
``$MEMVIT_TEST_ARTIFACTS`` when that variable names a directory to keep test artifacts in (CI).
Skips when Chromium (``apt-get install chromium``) or Playwright (``pip install playwright``; its own
browser download is not needed) is missing.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import pytest

from memvit.adapters import bundle_for
from memvit.memory_core import MemoryViT
from memvit.server.demo import BASE_WEIGHTS
from tests.factories import random_adapter
from tests.server.conftest import TOKEN, ServerProcess
from tests.server.samples import SampleRow, sample_rows

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(not BASE_WEIGHTS.is_file(), reason="the demo is not built"),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (Debian: apt-get install chromium)"),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install playwright)"
)
expect = sync_api.expect
TIMEOUT_MS = 20_000  # per step: generous for a loaded CI machine
# A few seconds on an idle machine; minutes on a 2-core one busy with training runs.
START_TIMEOUT_S = 300


@pytest.fixture
def demo_server(tmp_path) -> Iterator[Future[ServerProcess]]:
    """``memvit serve`` of the demo with an admin token, starting while the browser starts."""
    server = ServerProcess(None, tmp_path / "store", MEMVIT_ADMIN_TOKEN=TOKEN)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.start, START_TIMEOUT_S)
        try:
            yield started
        finally:
            wait([started])
            server.stop()


@pytest.fixture
def page(tmp_path) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def bundle_file(tmp_path: Path, name: str) -> Path:
    """An adapter bundle for the demo base, named ``name`` (random weights, 3 classes)."""
    engine = MemoryViT.from_timm(weights=BASE_WEIGHTS)
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(bundle_for(random_adapter(name, engine, m=1, classes=3), engine).to_bytes())
    return path


def check_answers(page, row: SampleRow, top_k: int) -> None:
    """The card of ``row``'s image shows ``top_k`` bars per task, the README's top-1 first."""
    card = page.locator(f'article.result[data-image="{row.file}"]')
    for task, (label, probability) in row.answers.items():
        bars = card.locator(f'section.task-result[data-task="{task}"] li.prediction')
        expect(bars).to_have_count(top_k)
        expect(bars.first.locator(".label")).to_have_text(label)
        shown = float(bars.first.locator(".percent").inner_text().rstrip("%")) / 100
        assert shown == pytest.approx(probability, abs=0.011), (row.file, task)


def keep_screenshot(page, tmp_path: Path) -> Path:
    shot = page.screenshot(path=tmp_path / "page.png", full_page=True)
    assert shot.startswith(b"\x89PNG")
    if artifacts := os.environ.get("MEMVIT_TEST_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "page.png", Path(artifacts) / "page.png")
    return tmp_path / "page.png"


def test_upload_predict_register_and_delete_in_a_browser(demo_server, page, tmp_path) -> None:
    bundle = bundle_file(tmp_path, "page-test")  # made while the server starts
    url = demo_server.result().url
    requests: list[str] = []
    page_errors: list[str] = []
    console_errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
    rows = {row.file: row for row in sample_rows()}
    garment, digit = rows["trouser.png"], rows["digit-7.png"]

    page.goto(f"{url}/")
    # The live set, and a task checkbox per task.
    expect(page.locator("#adapter-rows tr[data-adapter]")).to_have_count(2)
    expect(page.locator("#set-version")).to_contain_text("2 adapters")
    expect(page.locator("#task-list input")).to_have_count(3)
    expect(page.locator("#sample-list button")).to_have_count(len(rows))

    # A file that is not an image: the API's error, shown as it came.
    page.set_input_files("#images", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hi"}])
    expect(page.locator("#classify-error")).to_contain_text("415 NotAnImageError (notes.txt)")

    # A sample button sends that sample: every task answered, as the samples' README says.
    turned = rows["ankle-boot-rotated-90.png"]
    page.get_by_role("button", name=f"Classify the sample {turned.file}").click()
    expect(page.locator("article.result")).to_have_count(1)
    expect(page.locator("#classify-error")).to_be_hidden()
    check_answers(page, turned, top_k=3)

    # Fewer labels, one task off: the page asks again with top_k and tasks.
    page.fill("#top-k", "1")
    page.dispatch_event("#top-k", "change")
    page.uncheck('#task-list input[value="digits"]')
    expect(page.locator('section.task-result[data-task="digits"]')).to_have_count(0)
    expect(page.locator("li.prediction")).to_have_count(2)
    page.check('#task-list input[value="digits"]')
    page.fill("#top-k", "3")
    page.dispatch_event("#top-k", "change")
    check_answers(page, turned, top_k=3)

    # Registering: a wrong token is refused by the API, the right one makes the adapter live.
    page.fill("#token", "not-the-token")
    page.set_input_files("#bundle", str(bundle))
    page.click("#register")
    expect(page.locator("#admin-error")).to_contain_text("403 ForbiddenError")
    page.fill("#token", TOKEN)
    page.click("#register")
    expect(page.locator("#admin-status")).to_contain_text("Registered page-test")
    expect(page.locator("#admin-error")).to_be_hidden()
    expect(page.locator('#adapter-rows tr[data-adapter="page-test"]')).to_be_visible()
    expect(page.locator("#set-version")).to_contain_text("3 adapters")
    expect(page.locator("#task-list input")).to_have_count(4)
    assert "page-test" in [a["name"] for a in httpx.get(f"{url}/adapters").json()["adapters"]]

    # Two images in one upload, answered by every task, the new adapter's included.
    page.set_input_files("#images", [str(garment.path), str(digit.path)])
    expect(page.locator("article.result")).to_have_count(2)
    for row in (garment, digit):
        check_answers(page, row, top_k=3)
    expect(page.locator('section.task-result[data-task="page-test"] li.prediction')).to_have_count(2 * 3)
    screenshot = keep_screenshot(page, tmp_path)

    # Deleting, after the page's confirmation.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete adapter page-test").click()
    expect(page.locator('#adapter-rows tr[data-adapter="page-test"]')).to_have_count(0)
    expect(page.locator("#admin-status")).to_contain_text("Deleted page-test")
    assert httpx.get(f"{url}/adapters/page-test").status_code == 404

    assert page_errors == []
    # The API's refusals above are logged as failed loads; anything else (a CSP violation) is a fault.
    assert [m for m in console_errors if not m.startswith("Failed to load resource")] == []
    elsewhere = [asked for asked in requests if not asked.startswith((f"{url}/", "blob:", "data:"))]
    assert elsewhere == [], "the page asked another origin"
    assert screenshot.stat().st_size > 10_000


# Chromium's own Private Network Access would stop a public page's request before it reached the
# server; Firefox and Safari have no such block, and the server must not rely on one: it is off here.
WITHOUT_PNA = (
    "--disable-features=BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,"
    "PrivateNetworkAccessRespectPreflightResults,LocalNetworkAccessChecks"
)


def test_another_sites_page_cannot_change_adapters_in_a_browser(tmp_path) -> None:
    server = ServerProcess(None, tmp_path / "store", MEMVIT_ADMIN_TOKEN="")  # the loopback default
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(server.start, START_TIMEOUT_S)
            bundle = base64.b64encode(bundle_file(tmp_path, "digits").read_bytes()).decode()
            url = started.result().url
        before = httpx.get(f"{url}/adapters").json()
        # A multipart POST with mode no-cors is a "simple" request: the browser sends it without asking.
        attack = f"""<!doctype html><script>
          const bytes = Uint8Array.from(atob("{bundle}"), (c) => c.charCodeAt(0));
          const form = new FormData();
          form.append("bundle", new Blob([bytes]), "digits.safetensors");
          const options = {{ method: "POST", mode: "no-cors", body: form }};
          window.sent = fetch("{url}/adapters?replace=true", options)
            .then((r) => r.type, (e) => `failed: ${{e}}`);
        </script>"""
        with sync_api.sync_playwright() as playwright:
            rules = "--host-resolver-rules=MAP evil.example 127.0.0.1"
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[rules, WITHOUT_PNA])
            try:
                page = browser.new_page()
                page.route(
                    "http://attacker.example/",
                    lambda route: route.fulfill(body=attack, content_type="text/html"),
                )
                page.goto("http://attacker.example/")
                assert page.evaluate("window.sent") == "opaque"  # sent; its answer is hidden from the page
                # DNS rebinding: evil.example now resolves to this machine, and the page would be
                # same-origin with whatever answers there.
                rebound = page.goto(f"http://evil.example:{server.port}/")
                assert rebound is not None and rebound.status == 400
                assert "MEMVIT_ALLOWED_HOSTS" in rebound.json()["error"]["message"]
            finally:
                browser.close()
        assert httpx.get(f"{url}/adapters").json() == before  # "digits" is the demo's, unreplaced
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r'memvit_adapter_changes_total\{action="replace",result="403"\} 1\.0', metrics), (
            metrics
        )
    finally:
        server.stop()
