"""The page's routes (server/routers/ui.py): the page and its files, served from fixed lists with a
policy that lets it load nothing from elsewhere, outside the API's document and its metrics' way.
The page itself runs in a real browser in test_page.py."""

from __future__ import annotations

import re

from memvit.server.routers.ui import ASSETS, STATIC_DIR


def test_the_page_is_html_that_loads_only_from_this_server(client) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert r.headers["x-content-type-options"] == "nosniff"
    # Everything it links to is served here (relative URLs: they work behind a path prefix too).
    linked = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert {"ui/app.js", "ui/style.css"} <= set(linked)
    for url in linked:
        if url.startswith("ui/"):
            assert client.get(f"/{url}").status_code == 200, url
        else:
            assert url in ("docs", "data:,"), f"{url}: the page links only to this server"


def test_assets_have_their_types_and_nothing_else_is_served(client) -> None:
    for name, media_type in ASSETS.items():
        r = client.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media_type, name
        assert r.content == (STATIC_DIR / name).read_bytes()
    for path in ("/ui/index.html", "/ui/..%2F..%2Fsettings.py", "/ui/nothing.js", "/ui/"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert r.json()["error"]["type"] == "HTTPException", path


def test_no_file_of_the_page_loads_anything_from_elsewhere() -> None:
    """No CDN, no web fonts, no absolute URLs: the page works offline and under its CSP."""
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|@import|url\(", text), path.name


def test_samples_are_offered_only_with_the_demo(client) -> None:
    # This server runs tiny test weights, not the demo: the demo's garments would mean nothing to it.
    assert client.get("/ui/samples").json() == {"samples": []}
    assert client.get("/ui/samples/trouser.png").status_code == 404


def test_the_page_is_not_part_of_the_api(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/ui")]


def test_metrics_count_page_requests_by_route(client) -> None:
    client.get("/")
    client.get("/ui/app.js")
    client.get("/ui/missing.css")
    metrics = client.get("/metrics").text
    assert 'memvit_requests_total{method="GET",route="/",status="200"} 1.0' in metrics
    assert 'memvit_requests_total{method="GET",route="/ui/{name}",status="200"} 1.0' in metrics
    assert 'memvit_requests_total{method="GET",route="/ui/{name}",status="404"} 1.0' in metrics
