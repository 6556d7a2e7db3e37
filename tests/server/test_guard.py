"""The guard (server/edge/): management requests are checked before their body is read, and every
body is capped while it streams, so an oversized upload is never spooled to disk; every route of the
app has its row in the one route table.

Against a real ``memvit serve`` whose TMPDIR is a fresh directory, watched while uploads run. Raw
sockets: the body is sent from a thread while the response is read, because a server that answers
early and closes would otherwise reset a client still writing, and its answer would be lost. The
table and the body wrapper are also tested in process, without a server.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from memvit.server.edge.body import MULTIPART_ALLOWANCE
from tests.server.conftest import TOKEN, ServerProcess
from tests.server.test_api import jpeg

BUNDLE_CAP = 1_000_000  # MEMVIT_MAX_BUNDLE_BYTES of the server under test
IMAGE_CAP, IMAGES = 100_000, 2
BIG = 50 * 1024 * 1024  # many times any cap
CHUNK = 64 * 1024
BOUNDARY = "edgeboundary"

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="watches the server's /proc fds")


@pytest.fixture(scope="module")
def capped(tiny_weights, tmp_path_factory) -> Iterator[tuple[ServerProcess, Path]]:
    tmpdir = Path(os.path.realpath(tmp_path_factory.mktemp("server-tmp")))
    server = ServerProcess(
        tiny_weights,
        tmp_path_factory.mktemp("store"),
        TMPDIR=str(tmpdir),
        MEMVIT_ADMIN_TOKEN=TOKEN,
        MEMVIT_MAX_BUNDLE_BYTES=str(BUNDLE_CAP),
        MEMVIT_MAX_IMAGE_BYTES=str(IMAGE_CAP),
        MEMVIT_MAX_IMAGES_PER_REQUEST=str(IMAGES),
        MEMVIT_LOG_LEVEL="warning",  # its stderr is a pipe nobody reads
    ).start()
    try:
        yield server, tmpdir
    finally:
        server.stop()


def temp_bytes(pid: int, tmpdir: Path) -> int:
    """Bytes in ``tmpdir`` now: named files, and files the server holds open there (a spooled upload
    is usually an unnamed O_TMPFILE, visible only through /proc/PID/fd)."""
    sizes: dict[tuple[int, int], int] = {}
    paths = [str(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    paths += [str(p) for p in tmpdir.rglob("*")]
    for path in paths:
        try:
            if path.startswith("/proc/") and not os.readlink(path).startswith(str(tmpdir)):
                continue
            st = os.stat(path)
        except OSError:  # closed or deleted between listing and looking
            continue
        sizes[st.st_dev, st.st_ino] = st.st_size
    return sum(sizes.values())


class TempWatcher:
    """The most bytes ``tmpdir`` held, polled every few milliseconds while the block runs."""

    def __init__(self, pid: int, tmpdir: Path) -> None:
        self.pid, self.tmpdir, self.peak = pid, tmpdir, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, temp_bytes(self.pid, self.tmpdir))
            time.sleep(0.002)

    def __enter__(self) -> TempWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)  # whatever the server spooled last is still seen
        self._stop.set()
        self._thread.join()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    error: dict
    sent: int  # body bytes the socket accepted before the server stopped reading


def exchange(port: int, head: bytes, body: Iterable[bytes] = (), timeout: float = 20) -> Answer:
    """Sends ``head``, then ``body`` from a thread until the server stops taking it, while reading one
    response (with a Content-Length) here."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sent = 0

    def send_body() -> None:
        nonlocal sent
        try:
            for chunk in body:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server answered and closed: stop, as a real client would
            pass

    sock.sendall(head)
    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {data!r}"
            data += chunk
        raw, rest = data.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        while len(rest) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-response"
            rest += chunk
    finally:
        with contextlib.suppress(OSError):  # already reset by the server
            sock.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked in sendall
        sock.close()
        sender.join(timeout)
    return Answer(int(lines[0].split()[1]), headers, json.loads(rest).get("error", {}), sent)


def request_head(path: str, *, length: int | None, token: str | None = None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}",
    ]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def multipart(field: str, size: int) -> Iterator[bytes]:
    """One file part of ``size`` zero bytes, in chunks, never held whole."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field}"; filename="f.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    for start in range(0, size, CHUNK):
        yield bytes(min(CHUNK, size - start))
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def multipart_length(field: str, size: int) -> int:
    return sum(len(c) for c in multipart(field, 0)) + size


def chunked(parts: Iterable[bytes]) -> Iterator[bytes]:
    for part in parts:
        yield b"%x\r\n%s\r\n" % (len(part), part)
    yield b"0\r\n\r\n"


@pytest.mark.parametrize(
    "token,streaming,status,kind",
    [
        (None, False, 401, "NotAuthenticatedError"),
        ("wrong", False, 403, "ForbiddenError"),
        (TOKEN, False, 413, "RequestTooLargeError"),
        (TOKEN, True, 413, "RequestTooLargeError"),
    ],
    ids=["no-token", "wrong-token", "content-length-over-cap", "chunked-over-cap"],
)
def test_an_oversized_upload_is_never_spooled(capped, token, streaming, status, kind) -> None:
    """50 MB to POST /adapters (cap 1 MB): refused, the server stops reading, and its temp
    directory never holds more than the cap (before, all 50 MB were spooled, then 401 or 413)."""
    server, tmpdir = capped
    length = None if streaming else multipart_length("bundle", BIG)
    body = chunked(multipart("bundle", BIG)) if streaming else multipart("bundle", BIG)
    with TempWatcher(server.pid, tmpdir) as watcher:
        answer = exchange(server.port, request_head("/adapters", length=length, token=token), body)
    assert (answer.status, answer.error["type"]) == (status, kind), answer
    assert answer.headers["connection"] == "close"
    if status == 401:
        assert answer.headers["www-authenticate"] == "Bearer"
    if status == 413:
        assert f"a bundle over the {BUNDLE_CAP}-byte upload limit" in answer.error["message"]
    assert answer.sent < BIG, "the server read the whole body"
    assert watcher.peak <= BUNDLE_CAP + MULTIPART_ALLOWANCE, f"{watcher.peak} bytes spooled"


@pytest.mark.parametrize(
    "path,token", [("/adapters", None), ("/adapters", TOKEN), ("/classify", None)], ids=str
)
def test_a_refusal_needs_no_body_at_all(capped, path, token) -> None:
    """A Content-Length of 1 GB and not one body byte sent: answered at once (before, the server sat
    waiting for a body it was going to refuse)."""
    server, _ = capped
    answer = exchange(server.port, request_head(path, length=1 << 30, token=token), timeout=5)
    assert answer.status == (401 if path == "/adapters" and token is None else 413), answer
    assert answer.sent == 0


def test_classify_is_capped_while_it_streams(capped) -> None:
    """Chunked (no Content-Length) images over the request's cap (2 images of 100 kB): 413 from the
    edge, the rest unread (before: the whole body was read, then the per-image 413)."""
    server, _ = capped
    answer = exchange(server.port, request_head("/classify", length=None), chunked(multipart("image", BIG)))
    assert (answer.status, answer.error["type"]) == (413, "RequestTooLargeError"), answer
    assert f"at most {IMAGES} images of at most {IMAGE_CAP} bytes each" in answer.error["message"]
    assert answer.sent < BIG  # socket buffers hold megabytes: far less than all of it


def test_requests_under_the_caps_are_served(capped, make_bundle) -> None:
    server, _ = capped
    image = jpeg()
    part = (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
            f"Content-Type: image/jpeg\r\n\r\n"
        ).encode()
        + image
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )
    answer = exchange(server.port, request_head("/classify", length=None), chunked([part]))
    assert answer.status == 200, answer  # chunked is fine while under the cap
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        r = client.post("/classify", files={"image": ("a.jpg", image, "image/jpeg")})
        assert r.status_code == 200, r.text
        r = client.post("/adapters", files={"bundle": ("b", make_bundle("small").to_bytes())})
        assert r.status_code == 201, r.text
        assert client.delete("/adapters/small").status_code == 200
        # A refusal the router never saw is counted under the route it was meant for.
        assert exchange(server.port, request_head("/adapters", length=10)).status == 401
        metrics = client.get("/metrics").text
    assert 'memvit_requests_total{method="POST",route="/adapters",status="401"}' in metrics
