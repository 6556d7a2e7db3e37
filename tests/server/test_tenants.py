"""One key per tenant (MEMVIT_API_KEYS_FILE): a key changes and reads only the adapters its glob covers,
every attempt to change the set is audited, and a revoked key is refused within one reload interval.

Against real uvicorn, with the admin token, an ``acme-*`` key, a ``globex-*`` key and a read-only
``acme-*`` key in a keys file written by ``memvit keys``' own functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from memvit.server.cli import loopback_admin_default
from memvit.server.http.app import preflight
from memvit.server.settings import Settings
from memvit.server.tenancy.key_file import add_key, revoke_key
from memvit.server.tenancy.keys import hash_key
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.test_api import jpeg
from tests.server.test_guard import exchange, request_head

RELOAD = 0.2  # MEMVIT_API_KEYS_RELOAD_SECONDS of the server under test


@dataclass
class Tenants:
    url: str
    keys_file: Path
    store: Path
    acme: str
    globex: str
    reader: str  # acme-*, read only

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture(params=[False, True], ids=["reads-open", "read-key-required"])
def tenants(request, tiny_weights, store, tmp_path, make_bundle) -> Iterator[Tenants]:
    keys_file = tmp_path / "keys.json"
    acme = add_key(keys_file, "acme", ["acme-*"], read=True, write=True)
    globex = add_key(keys_file, "globex", ["globex-*"], read=True, write=True)
    reader = add_key(keys_file, "acme-reader", ["acme-*"], read=True, write=False)
    settings = Settings(
        _env_file=None,
        weights=tiny_weights,
        adapter_store=store,
        port=free_port(),
        admin_token=TOKEN,
        api_keys_file=keys_file,
        api_keys_reload_seconds=RELOAD,
        require_read_key=request.param,
        max_wait_ms=2,
    )
    preflight(settings)
    with running_server(settings) as url:
        t = Tenants(url, keys_file, store, acme, globex, reader)
        with t.client(globex) as client:
            r = client.post("/adapters", files={"bundle": ("b", make_bundle("globex-dogs").to_bytes())})
            assert r.status_code == 201, r.text
        yield t


def stored(t: Tenants) -> list[str]:
    """The adapters registered in the store, as the admin sees them (the store's journal decides)."""
    listing = httpx.get(f"{t.url}/adapters", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return sorted(a["name"] for a in listing["adapters"])


def classify(client: httpx.Client, **params) -> httpx.Response:
    return client.post("/classify", files={"image": ("a.jpg", jpeg(), "image/jpeg")}, params=params)


def test_a_key_registers_its_names_and_only_those(tenants, make_bundle) -> None:
    with tenants.client(tenants.acme) as acme, tenants.client(TOKEN) as admin:
        r = acme.post("/adapters", files={"bundle": ("b", make_bundle("acme-cats").to_bytes())})
        assert r.status_code == 201, r.text
        assert r.json()["adapter"]["name"] == "acme-cats" and "globex" not in r.text  # not named to acme
        before = (stored(tenants), admin.get("/adapters").json()["registry"])
        r = acme.post(
            "/adapters",
            params={"replace": "true"},
            files={"bundle": ("b", make_bundle("globex-dogs").to_bytes())},
        )
        assert r.status_code == 403, r.text
        assert r.json()["error"] == {
            "type": "ForbiddenError",
            "message": "this key may not change adapters named 'globex-dogs' (it covers acme-*)",
        }
        # Nothing half-registered: neither the store nor the live set moved.
        assert (stored(tenants), admin.get("/adapters").json()["registry"]) == before
        # Extending another tenant's adapter would reach into it: the parent must be readable too.
        child = make_bundle("acme-pups", parent="globex-dogs").to_bytes()
        r = acme.post("/adapters", files={"bundle": ("b", child)})
        assert r.status_code == 403 and "may not read adapters named 'globex-dogs'" in r.text, r.text
        # DELETE: the name is in the path, refused at the guard.
        r = acme.delete("/adapters/globex-dogs")
        assert r.status_code == 403 and "may not change adapters named 'globex-dogs'" in r.text, r.text
        assert "globex-dogs" in stored(tenants)
        assert acme.delete("/adapters/acme-cats").status_code == 200
        # The admin token covers every name.
        assert admin.delete("/adapters/globex-dogs").status_code == 200


def test_a_read_only_key_is_refused_before_the_body(tenants) -> None:
    """A gigabyte announced, no byte sent: refused from the headers alone."""
    port = int(tenants.url.rsplit(":", 1)[1])
    answer = exchange(port, request_head("/adapters", length=1 << 30, token=tenants.reader), timeout=5)
    assert (answer.status, answer.sent) == (403, 0), answer
    assert answer.error["message"] == "key 'acme-reader' may not change adapters: it is read-only"


def test_a_key_reads_only_its_adapters(tenants, make_bundle) -> None:
    required = tenants.client(None).get("/adapters").status_code == 401
    with tenants.client(tenants.acme) as acme, tenants.client(TOKEN) as admin:
        assert acme.post("/adapters", files={"bundle": ("b", make_bundle("acme-cats").to_bytes())}).is_success
        listing = acme.get("/adapters").json()
        assert [a["name"] for a in listing["adapters"]] == ["acme-cats"]
        assert "globex" not in json.dumps(listing)
        assert acme.get("/adapters/acme-cats").status_code == 200
        for name in ("globex-dogs", "globex-nothing"):  # existing or not: the same 403
            r = acme.get(f"/adapters/{name}")
            assert r.status_code == 403 and f"may not read adapters named '{name}'" in r.text, r.text

        # Unfiltered, a key computes base and its own adapters only.
        r = classify(acme)
        assert r.status_code == 200, r.text
        assert set(r.json()["results"][0]["tasks"]) == {"base", "acme-cats"}
        assert r.json()["tasks"] == ["base", "acme-cats"]
        r = classify(acme, tasks="base,globex-dogs")
        assert r.status_code == 403 and r.json()["error"]["field"] == "tasks", r.text
        assert "'globex-dogs'" in r.json()["error"]["message"]
        r = classify(acme, tasks="acme-nothing")
        assert r.status_code == 422 and "globex" not in r.text, r.text  # the known tasks listed are its own
        # The admin sees everything, as before keys.
        assert set(classify(admin).json()["results"][0]["tasks"]) == {"base", "acme-cats", "globex-dogs"}

    with tenants.client(None) as anonymous, tenants.client("mvk_not-a-key") as stranger:
        assert stranger.get("/adapters").status_code == 403  # a bearer value that matches no key
        if required:
            r = anonymous.get("/adapters")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            assert classify(anonymous).status_code == 401
            assert anonymous.get("/adapters/globex-dogs").status_code == 401
        else:  # reads open: anyone sees everything, as before keys
            assert set(classify(anonymous).json()["results"][0]["tasks"]) == {
                "base",
                "acme-cats",
                "globex-dogs",
            }
        assert anonymous.get("/healthz").status_code == 200  # never needs a key


def test_every_change_is_audited_and_the_key_never_logged(tenants, make_bundle, caplog) -> None:
    if int(os.environ.get("MEMVIT_TEST_API_PROCESSES", "1")) > 1:
        pytest.skip("audit lines are logged by the API processes; caplog reads this process's")
    with caplog.at_level(logging.INFO, logger="memvit.audit"), tenants.client(tenants.acme) as acme:
        data = make_bundle("acme-cats").to_bytes()
        assert acme.post("/adapters", files={"bundle": ("b", data)}).status_code == 201
        assert (
            acme.post("/adapters", files={"bundle": ("b", make_bundle("globex-x").to_bytes())}).status_code
            == 403
        )
        assert acme.delete("/adapters/globex-dogs").status_code == 403
        assert acme.post("/adapters", content=b"not multipart").status_code == 415
        assert acme.delete("/adapters/acme-cats").status_code == 200
        metrics = acme.get("/metrics").text
    lines = [r.getMessage() for r in caplog.records if r.name == "memvit.audit"]
    assert len(lines) == 5, lines
    digest = hashlib.sha256(data).hexdigest()
    assert re.fullmatch(
        rf"time=\S+Z action=register name=acme-cats key=acme sha256={digest} result=201", lines[0]
    )
    assert "action=register name=globex-x key=acme" in lines[1] and lines[1].endswith("result=403")
    assert "action=delete name=globex-dogs key=acme sha256=- result=403" in lines[2]
    assert "action=register name=- key=acme sha256=- result=415" in lines[3]
    assert f"action=delete name=acme-cats key=acme sha256={digest} result=200" in lines[4]
    for secret in (tenants.acme, hash_key(tenants.acme)):
        assert all(secret not in line for line in lines)
        assert all(secret not in r.getMessage() for r in caplog.records)

    def count(action: str, result: str) -> float:
        found = re.search(
            rf'memvit_adapter_changes_total{{action="{action}",result="{result}"}} (\S+)', metrics
        )
        return float(found.group(1)) if found else 0.0

    # The fixture's globex-dogs registration counts too; names are never labels.
    assert (count("register", "201"), count("register", "403"), count("register", "415")) == (2, 1, 1)
    assert (count("delete", "403"), count("delete", "200")) == (1, 1)
    labels = re.findall(r"memvit_adapter_changes_total\{([^}]*)\}", metrics)
    assert labels and all(set(re.findall(r"(\w+)=", one)) == {"action", "result"} for one in labels)


def test_a_revoked_key_is_refused_within_one_reload_interval(tenants, make_bundle) -> None:
    with tenants.client(tenants.acme) as acme:
        assert acme.post("/adapters", files={"bundle": ("b", make_bundle("acme-cats").to_bytes())}).is_success
        revoke_key(tenants.keys_file, "acme")
        time.sleep(RELOAD * 1.5)
        r = acme.delete("/adapters/acme-cats")
        assert r.status_code == 403 and "not valid" in r.text, r.text
        assert acme.get("/adapters").status_code == 403
    with tenants.client(tenants.globex) as globex:  # the other keys are unaffected
        assert globex.get("/adapters/globex-dogs").status_code == 200


def test_keys_close_anonymous_management_and_a_bad_keys_file_stops_the_start(tmp_path) -> None:
    keys_file = tmp_path / "keys.json"
    add_key(keys_file, "acme", ["acme-*"], read=True, write=True)
    with_keys = Settings(_env_file=None, api_keys_file=keys_file, adapter_store=str(tmp_path / "store"))
    assert loopback_admin_default(with_keys).allow_anonymous_admin is False
    assert not with_keys.model_copy(update={"allow_anonymous_admin": True}).anonymous_admin
    preflight(with_keys)
    for broken, problem in ((tmp_path / "missing.json", "No such file"), (tmp_path / "bad.json", "not JSON")):
        if broken.name == "bad.json":
            broken.write_text("{")
        with pytest.raises(ValueError, match=f"MEMVIT_API_KEYS_FILE: .*{problem}"):
            preflight(with_keys.model_copy(update={"api_keys_file": broken}))
    nobody = Settings(_env_file=None, require_read_key=True, adapter_store=str(tmp_path / "store"))
    with pytest.raises(ValueError, match="MEMVIT_REQUIRE_READ_KEY=true needs MEMVIT_API_KEYS_FILE"):
        preflight(nobody)
