"""Safe by default: with no admin token, POST/DELETE /adapters are refused unless explicitly opted out
(MEMVIT_ALLOW_ANONYMOUS_ADMIN), and ``memvit serve`` opts out by itself only on a loopback address."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pydantic import SecretStr

from memvit.server.cli import loopback_admin_default
from memvit.server.edge.access import check_admin
from memvit.server.errors import AdminDisabledError, ForbiddenError, NotAuthenticatedError
from memvit.server.settings import Settings
from tests.server.conftest import TOKEN, ServerProcess, free_port, running_server


@pytest.mark.parametrize(
    "token,anonymous,header,refused",
    [
        (None, False, None, AdminDisabledError),
        (None, False, f"Bearer {TOKEN}", AdminDisabledError),
        (None, True, None, None),
        (TOKEN, False, None, NotAuthenticatedError),
        (TOKEN, True, None, NotAuthenticatedError),  # a token always wins over the opt-out
        (TOKEN, False, f"Basic {TOKEN}", NotAuthenticatedError),
        (TOKEN, False, "Bearer nope", ForbiddenError),
        (TOKEN, False, f"bearer {TOKEN}", None),
    ],
)
def test_the_admin_rule(token, anonymous, header, refused) -> None:
    settings = Settings(_env_file=None, admin_token=token, allow_anonymous_admin=anonymous)
    if refused is None:
        check_admin(settings, header)
    else:
        with pytest.raises(refused) as caught:
            check_admin(settings, header)
        assert type(caught.value) is refused
        if refused is AdminDisabledError:
            assert "MEMVIT_ADMIN_TOKEN" in str(caught.value)
            assert "MEMVIT_ALLOW_ANONYMOUS_ADMIN=true" in str(caught.value)


def test_without_a_token_management_is_refused_unless_opted_out(tiny_weights, store, make_bundle) -> None:
    data = make_bundle("open").to_bytes()
    settings = Settings(_env_file=None, weights=tiny_weights, adapter_store=store, port=free_port())
    with running_server(settings) as url, httpx.Client(base_url=url) as client:
        r = client.post("/adapters", files={"bundle": ("b", data)})
        assert r.status_code == 403 and r.json()["error"]["type"] == "AdminDisabledError", r.text
        assert "MEMVIT_ADMIN_TOKEN" in r.json()["error"]["message"]
        assert client.delete("/adapters/open").status_code == 403
        assert client.get("/adapters").status_code == 200  # reading needs no token
    assert list(store.rglob("*.safetensors")) == []

    opted_out = settings.model_copy(update={"allow_anonymous_admin": True, "port": free_port()})
    with running_server(opted_out) as url, httpx.Client(base_url=url) as client:
        assert client.post("/adapters", files={"bundle": ("b", data)}).status_code == 201
        assert client.delete("/adapters/open").status_code == 200


@pytest.mark.parametrize(
    "host,opens",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),  # the image's default: never opened
        ("::", False),
        ("192.168.1.5", False),
        ("example.com", False),
    ],
)
def test_serve_opens_management_only_on_loopback(host, opens) -> None:
    settings = Settings(_env_file=None, host=host)
    assert loopback_admin_default(settings).allow_anonymous_admin is opens
    with_token = Settings(_env_file=None, host=host, admin_token=SecretStr(TOKEN))
    assert loopback_admin_default(with_token).allow_anonymous_admin is False


def test_an_explicit_no_is_kept_on_loopback(monkeypatch) -> None:
    monkeypatch.setenv("MEMVIT_ALLOW_ANONYMOUS_ADMIN", "false")
    assert loopback_admin_default(Settings(_env_file=None)).allow_anonymous_admin is False


SERVE_HOSTS = [("127.0.0.1", 201), ("0.0.0.0", 403)]


@pytest.fixture(scope="module")
def serving_without_a_token(tiny_weights, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """``memvit serve`` with no token on each address, each on its own new store, loading at once (two
    imports of torch on two cores: about one start's time, not two). Each test waits for its own."""
    servers = {
        host: ServerProcess(
            tiny_weights, tmp_path_factory.mktemp("admin") / "store", MEMVIT_HOST=host, MEMVIT_ADMIN_TOKEN=""
        ).spawn()
        for host, _ in SERVE_HOSTS
    }
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("host,status", SERVE_HOSTS)
def test_memvit_serve_without_a_token(serving_without_a_token, make_bundle, host, status) -> None:
    """The real command: on loopback it stays convenient (and says so); bound to every address, as in
    the Docker image, management is refused."""
    server = serving_without_a_token[host].wait_ready(120)
    try:
        r = httpx.post(f"{server.url}/adapters", files={"bundle": ("b", make_bundle("x").to_bytes())})
    finally:
        server.stop()
    log = server.proc.stderr.read()
    assert r.status_code == status, r.text
    assert ("POST/DELETE /adapters are open to local clients" in log) is (status == 201), log
