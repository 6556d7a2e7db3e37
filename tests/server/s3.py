"""A real S3-compatible server for the object-store tests: moto's, as a child process on loopback.

moto implements PutObject's conditional writes (``If-None-Match: *`` and ``If-Match: <etag>``,
answering 412 when they do not hold), which is what the store's create-if-absent and
replace-if-unchanged rest on. Its threaded server checks the condition and then writes without a
lock, so two racing requests could both pass; we run its WSGI app single-threaded, which makes every
request atomic, as S3's own conditional writes are. (An HTTP/1.0 server: each request is its own
connection, so one idle client cannot hold it.)
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.server.launcher import free_port

_SERVE = (
    "import sys; from werkzeug.serving import run_simple; "
    "from moto.server import DomainDispatcherApplication, create_backend_app; "
    "app = DomainDispatcherApplication(create_backend_app); "
    "run_simple('127.0.0.1', int(sys.argv[1]), app, threaded=False)"
)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "memvit-test",
    "AWS_SECRET_ACCESS_KEY": "memvit-test",
    "AWS_REGION": "us-east-1",
}


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """Start the server; yields the AWS environment variables that point a client at it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the S3 test server did not start") from None
                time.sleep(0.05)
        yield {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
    finally:
        proc.kill()
        proc.wait(timeout=10)


def s3_client(env: dict[str, str]):
    """A boto3 S3 client for the test server ``env`` describes (the ``s3_env`` fixture's variables)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )


def new_bucket(env: dict[str, str]) -> str:
    """A fresh bucket; returns its name."""
    name = f"memvit-{uuid.uuid4().hex[:12]}"
    s3_client(env).create_bucket(Bucket=name)
    return name
