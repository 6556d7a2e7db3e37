"""The OpenAPI document is complete, and the running service keeps to it (schemathesis).

Schemathesis generates requests from the document (valid and invalid, fixed seed, bounded) against a
real uvicorn server and checks every answer: no 5xx, every status documented, every body matching
its schema, invalid requests refused, Allow headers right. One check is left out, with its reason:
``positive_data_acceptance`` expects every schema-valid request to succeed, but a schema cannot say
"a decodable image" or "a valid safetensors bundle": random bytes fit it and are rightly refused.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from memvit.server.tenancy.key_file import add_key
from tests.server.conftest import TOKEN, free_port, running_server

pytest.importorskip("schemathesis", reason="the OpenAPI run needs the dev extra (schemathesis)")

CONFIG = """
[checks.negative_data_rejection]
# 413 is how the service refuses too many images (the schema's maxItems) and oversized bodies.
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
"""


def test_every_route_documents_its_statuses_with_the_real_error_body(client, settings) -> None:
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    expected = {
        ("post", "/classify"): {"200", "400", "401", "403", "408", "413", "415", "422", "429", "503"},
        ("get", "/usage"): {"200", "400", "401", "403", "404", "422", "503"},
        ("get", "/adapters"): {"200", "400", "401", "403", "422", "503"},
        ("post", "/adapters"): {"201", "400", "401", "403", "408", "409", "413", "415", "422", "503"},
        ("get", "/adapters/{name}"): {"200", "400", "401", "403", "404", "422", "503"},
        ("delete", "/adapters/{name}"): {"200", "400", "401", "403", "404", "409", "422", "503"},
    }
    # The Host check can answer any route 400.
    assert all("400" in op["responses"] for ops in paths.values() for op in ops.values())
    for (method, path), statuses in expected.items():
        responses = paths[path][method]["responses"]
        assert set(responses) == statuses, (method, path)
        for status in statuses - {"200", "201"}:
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (method, path, status)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    image = next(
        schema["properties"]["image"]
        for schema in doc["components"]["schemas"].values()
        if "image" in schema.get("properties", {})
    )
    assert (image["minItems"], image["maxItems"]) == (1, settings.max_images_per_request)


def test_a_wrong_method_lists_every_allowed_one(client) -> None:
    r = client.request("PUT", "/adapters/x")
    assert r.status_code == 405
    assert r.headers["allow"] == "DELETE, GET"
    assert r.json()["error"]["type"] == "HTTPException"


@pytest.mark.parametrize("caller", ["admin", "anonymous", "tenant"])
def test_schemathesis_finds_nothing(settings, tmp_path, caller) -> None:
    """As the admin, anonymously, and as a tenant's key (``a*``) with read keys required: every 401 and
    403 of the keys is documented too."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    settings = settings.model_copy(update={"port": free_port()})
    bearer = TOKEN if caller == "admin" else None
    if caller == "tenant":
        keys_file = tmp_path / "keys.json"
        bearer = add_key(keys_file, "tenant", ["a*"], read=True, write=True)
        settings = settings.model_copy(update={"api_keys_file": keys_file, "require_read_key": True})
    with running_server(settings) as url:
        command = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
            f"{url}/openapi.json", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", "40", "--seed", "20261123", "--generation-deterministic",
            "--request-timeout", "30", "--no-color",
        ]  # fmt: skip
        if bearer is not None:
            command += ["--header", f"Authorization: Bearer {bearer}"]
        # In tmp_path: schemathesis keeps its own files (.schemathesis/) in the working directory.
        run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert httpx.get(f"{url}/readyz").status_code == 200  # still serving
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
