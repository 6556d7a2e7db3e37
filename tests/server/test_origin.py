"""Browser-borne requests on the loopback default (server/edge/origin.py): another site's page cannot
change adapters (Origin, Sec-Fetch-Site: 403), a DNS-rebinding page cannot reach the server at all
(Host: 400), and what is not a browser, or is this server's own page, works as before.

The server is as ``memvit serve`` leaves it on 127.0.0.1 with no token: anonymous management on.
Against real uvicorn (the Host and Origin headers are what the HTTP stack hands over); the pure rules
are checked in process too.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator

import httpx
import pytest
from starlette.datastructures import Headers

from memvit.server.edge.origin import OriginPolicy, split_host
from memvit.server.errors import CrossSiteRequestError, HostNotAllowedError
from memvit.server.settings import Settings
from tests.server.conftest import TOKEN, free_port, running_server

EVIL = "https://evil.example"


@pytest.fixture
def open_settings(tiny_weights, store) -> Settings:
    """``memvit serve``'s loopback default: no token, anonymous management on."""
    return Settings(
        _env_file=None,
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        allow_anonymous_admin=True,
    )


@pytest.fixture
def loopback(open_settings, make_bundle) -> Iterator[tuple[httpx.Client, str]]:
    """The open loopback server, holding one adapter ("cats") that a cross-site page would replace."""
    with running_server(open_settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/adapters", files={"bundle": ("b", make_bundle("cats").to_bytes())})
        assert r.status_code == 201, r.text
        yield client, url


def served(client: httpx.Client) -> tuple[list[str], str]:
    """The registered names and the sha256 of "cats": what a refused change must leave as it was."""
    listing = client.get("/adapters").json()
    return [a["name"] for a in listing["adapters"]], next(a["sha256"] for a in listing["adapters"])


def counted(client: httpx.Client, action: str, result: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf'memvit_adapter_changes_total{{action="{action}",result="{result}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "headers,why",
    [
        ({"Origin": EVIL, "Sec-Fetch-Site": "cross-site"}, "Origin https://evil.example is not this server"),
        (
            {"Origin": EVIL},
            "Origin https://evil.example is not this server",
        ),  # a browser without Fetch Metadata
        ({"Sec-Fetch-Site": "cross-site"}, "Sec-Fetch-Site: cross-site"),
        ({"Origin": "null"}, "Origin null"),  # a sandboxed iframe or a file:// page
    ],
    ids=["origin-and-fetch-site", "origin-only", "fetch-site-only", "null-origin"],
)
def test_a_cross_site_replace_is_refused_and_changes_nothing(loopback, make_bundle, headers, why) -> None:
    client, _ = loopback
    before = served(client)
    r = client.post(
        "/adapters",
        params={"replace": "true"},
        files={"bundle": ("b", make_bundle("cats", seed=7).to_bytes())},
        headers=headers,
    )
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "CrossSiteRequestError" and why in error["message"], error
    assert "may not change adapters" in error["message"]
    assert served(client) == before
    assert counted(client, "replace", "403") == 1


def test_a_cross_site_delete_is_refused(loopback) -> None:
    client, _ = loopback
    r = client.delete("/adapters/cats", headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "CrossSiteRequestError", r.text
    assert served(client)[0] == ["cats"]


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:3000"])
def test_a_same_site_page_is_refused(loopback, make_bundle, origin) -> None:
    """Another port of this machine (a dev server, a notebook) is same-site, not this server."""
    client, _ = loopback
    r = client.post(
        "/adapters",
        files={"bundle": ("b", make_bundle("dogs").to_bytes())},
        headers={"Origin": origin, "Sec-Fetch-Site": "same-site"},
    )
    assert r.status_code == 403 and "same-site requests may not change adapters" in r.text, r.text
    r = client.post(
        "/adapters", files={"bundle": ("b", make_bundle("dogs").to_bytes())}, headers={"Origin": origin}
    )
    assert r.status_code == 403 and f"Origin {origin} is not this server" in r.text, r.text
    assert "dogs" not in served(client)[0]


@pytest.mark.parametrize("method,path", [("GET", "/adapters"), ("POST", "/adapters"), ("GET", "/healthz")])
def test_a_rebinding_name_is_refused_on_every_route(loopback, make_bundle, method, path) -> None:
    client, _ = loopback
    files = {"bundle": ("b", make_bundle("dogs").to_bytes())} if method == "POST" else None
    r = client.request(method, path, files=files, headers={"Host": "evil.example:8000"})
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "type": "HostNotAllowedError",
            "message": "Host 'evil.example:8000' is not allowed: add it to MEMVIT_ALLOWED_HOSTS "
            "(comma-separated) if this server is reached by that name",
        }
    }
    assert "dogs" not in served(client)[0]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "127.0.0.1", "[::1]", "127.0.0.2", "10.1.2.3"])
def test_loopback_names_and_ip_literals_are_this_server(loopback, host) -> None:
    """A browser sends an IP literal only when its page's origin is that address: never rebinding."""
    client, url = loopback
    port = url.rsplit(":", 1)[1]
    assert client.get("/adapters", headers={"Host": f"{host}:{port}"}).status_code == 200


def test_no_host_at_all_is_refused(loopback) -> None:
    _, url = loopback
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert json.loads(body)["error"]["type"] == "HostNotAllowedError"


def test_this_servers_own_page_and_non_browsers_still_manage(loopback, make_bundle) -> None:
    client, url = loopback
    same_origin = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    r = client.post("/adapters", files={"bundle": ("b", make_bundle("dogs").to_bytes())}, headers=same_origin)
    assert r.status_code == 201, r.text
    port = url.rsplit(":", 1)[1]  # the page opened as localhost: Origin and Host agree
    by_name = {
        "Origin": f"http://localhost:{port}",
        "Host": f"localhost:{port}",
        "Sec-Fetch-Site": "same-origin",
    }
    assert client.delete("/adapters/dogs", headers=by_name).status_code == 200
    # curl, the Python client: neither header
    r = client.post("/adapters", files={"bundle": ("b", make_bundle("dogs").to_bytes())})
    assert r.status_code == 201, r.text
    # a typed URL or a bookmark (Sec-Fetch-Site: none) is the user, not a page
    assert client.delete("/adapters/dogs", headers={"Sec-Fetch-Site": "none"}).status_code == 200
    assert counted(client, "register", "201") == 3  # "cats" by the fixture, "dogs" twice


def test_allowed_hosts_admit_a_proxys_name(open_settings, make_bundle) -> None:
    """Behind a proxy at https://memvit.example (TLS ends there): its name, and its pages' Origin."""
    settings = open_settings.model_copy(update={"allowed_hosts": ["memvit.example", "*.memvit.internal"]})
    with running_server(settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        for host in ("memvit.example", "a.memvit.internal:8000"):
            assert client.get("/adapters", headers={"Host": host}).status_code == 200, host
        assert client.get("/adapters", headers={"Host": "memvit.internal"}).status_code == 400
        page = {"Host": "memvit.example", "Origin": "https://memvit.example", "Sec-Fetch-Site": "same-origin"}
        r = client.post("/adapters", files={"bundle": ("b", make_bundle("dogs").to_bytes())}, headers=page)
        assert r.status_code == 201, r.text
        evil = {"Host": "memvit.example", "Origin": EVIL}
        assert client.delete("/adapters/dogs", headers=evil).status_code == 403


def test_a_public_bind_with_a_token_keeps_any_host(tiny_weights, store, make_bundle) -> None:
    """Bound to every address with a token and no list: the name is the proxy's business, as before."""
    settings = Settings(
        _env_file=None,
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        host="0.0.0.0",
        admin_token=TOKEN,
    )
    with running_server(settings) as url, httpx.Client(base_url=url, timeout=30) as client:
        any_host = {"Host": "whatever.example", "Authorization": f"Bearer {TOKEN}"}
        assert client.get("/adapters", headers=any_host).status_code == 200
        r = client.post(
            "/adapters", files={"bundle": ("b", make_bundle("dogs").to_bytes())}, headers=any_host
        )
        assert r.status_code == 201, r.text
        # Origin is checked on every bind: a page of another site holding the token is still refused.
        r = client.delete("/adapters/dogs", headers={**any_host, "Origin": EVIL})
        assert r.status_code == 403, r.text


# -- the rules in process ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,parsed",
    [
        ("Example.COM:8000", ("example.com", 8000)),
        ("example.com.", ("example.com", None)),
        ("[::1]:80", ("::1", 80)),
        ("[::1]", ("::1", None)),
        ("::1", ("::1", None)),
    ],
)
def test_split_host(value, parsed) -> None:
    assert split_host(value) == parsed


@pytest.mark.parametrize(
    "bind,listed,host,ok",
    [
        ("127.0.0.1", [], "localhost:8000", True),
        ("127.0.0.1", [], "evil.example", False),
        ("localhost", [], "evil.example", False),
        ("::1", [], "[::1]:8000", True),
        ("127.0.0.1", [], "not-a-port:x", False),
        ("0.0.0.0", [], "evil.example", True),  # a public bind with no list: unchecked
        ("0.0.0.0", ["memvit.example"], "evil.example", False),
        ("0.0.0.0", ["memvit.example"], "memvit.example:443", True),
        ("0.0.0.0", ["*"], "evil.example", True),
        ("myhost.lan", [], "myhost.lan", True),  # a name bind: not loopback, unchecked
    ],
)
def test_host_rule(bind, listed, host, ok) -> None:
    policy = OriginPolicy(Settings(_env_file=None, host=bind, allowed_hosts=listed))
    headers = Headers({"host": host})
    if ok:
        policy.check_host(headers)
    else:
        with pytest.raises(HostNotAllowedError):
            policy.check_host(headers)


@pytest.mark.parametrize(
    "host,origin,scheme,listed,ok",
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000", "http", [], True),
        ("127.0.0.1:80", "http://127.0.0.1", "http", [], True),  # default ports normalised
        ("memvit.example", "https://memvit.example:443", "https", [], True),
        ("127.0.0.1:8000", "http://127.0.0.1:8001", "http", [], False),
        ("127.0.0.1:8000", "http://localhost:8000", "http", [], False),  # another origin, same machine
        ("backend:8000", "https://memvit.example", "http", ["memvit.example"], True),  # a proxy rewrote Host
        ("backend:8000", "https://evil.example", "http", ["*"], False),  # "*" admits hosts, not pages
        ("127.0.0.1:8000", "not a url", "http", [], False),
    ],
)
def test_origin_rule(host, origin, scheme, listed, ok) -> None:
    policy = OriginPolicy(Settings(_env_file=None, allowed_hosts=listed))
    headers = Headers({"host": host, "origin": origin})
    if ok:
        policy.check_origin(headers, scheme)
    else:
        with pytest.raises(CrossSiteRequestError):
            policy.check_origin(headers, scheme)
