"""``POST /classify`` as a raw route (server/routers/classify_raw.py) against the same route through
FastAPI alone (``create_app(raw_classify=False)``): every kind of request, plain and not, good and
bad, sent as the same bytes to both; the answers must be the same bytes (the Date header aside, and
Server-Timing's durations), and so must the metrics they leave."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator

import pytest

from memvit.server.http.app import create_app
from memvit.server.settings import Settings
from memvit.server.tenancy.key_file import add_key
from memvit.server.tenancy.policy import Limits, Policy
from tests.server.conftest import TOKEN, free_port, running_server
from tests.server.test_api import jpeg

B = "bNdRy"


def part(data: bytes, filename: str = "a.jpg", name: str = "image", extra: str = "") -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
    return f"--{B}\r\nContent-Disposition: {disposition}\r\n{extra}\r\n".encode() + data + b"\r\n"


def body(*parts: bytes, preamble: bytes = b"", epilogue: bytes = b"") -> bytes:
    return preamble + b"".join(parts) + f"--{B}--\r\n".encode() + epilogue


def request(
    data: bytes,
    query: str = "",
    *,
    auth: str | None = None,
    content_type: str = f"multipart/form-data; boundary={B}",
    host: str = "127.0.0.1",
    method: str = "POST",
    path: str = "/classify",
    chunked: bool = False,
    length: int | None = None,
) -> bytes:
    head = [f"{method} {path}{'?' + query if query else ''} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    if auth:
        head.append(f"Authorization: Bearer {auth}")
    if chunked:
        head.append("Transfer-Encoding: chunked")
        data = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (data[:100], data[100:]) if c) + b"0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(data) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def exchange(url: str, raw: bytes, *, leave: bool = False) -> bytes:
    """The answer to ``raw``; ``leave``: the client stops sending after it (its body cut short)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        if leave:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    answer = re.sub(rb"\r\ndate: [^\r]*", b"", answer)
    return re.sub(rb";dur=[0-9.]+", b";dur=*", answer)  # Server-Timing: the stages, not their times


@pytest.fixture(scope="module")
def servers(tiny_weights, tmp_path_factory, tiny_engine_for_bundles) -> Iterator[tuple[str, str, dict]]:
    from memvit.adapters import bundle_for, save_bundle
    from tests.conftest import random_adapter

    tmp = tmp_path_factory.mktemp("raw")
    store = tmp / "store"
    store.mkdir()
    # One adapter: with several, an unfiltered answer lists them in the order each server loaded them.
    engine = tiny_engine_for_bundles
    save_bundle(bundle_for(random_adapter("acme-one", engine), engine), store / "acme-one.safetensors")
    keys_file = tmp / "keys.json"
    slow = Policy(limits=Limits(images_per_second=0.001, burst=2))
    keys = {
        "acme": add_key(keys_file, "acme", ["acme-*"], read=True, write=False),
        "limited": add_key(keys_file, "limited", ["*"], read=True, write=False, policy=slow),
    }
    settings = Settings(
        weights=tiny_weights, adapter_store=store, port=free_port(), admin_token=TOKEN,
        api_keys_file=keys_file, max_wait_ms=1, usage_log=False, server_timing=True,
    )  # fmt: skip
    other = settings.model_copy(update={"port": free_port()})
    with (
        running_server(settings) as raw,
        running_server(other, create_app(other, raw_classify=False)) as general,
    ):
        yield raw, general, keys


def cases(keys: dict) -> list[bytes]:
    one, other = jpeg(), jpeg((10, 200, 30), (64, 50))
    plain = body(part(one))
    return [
        request(plain),
        request(body(part(one), part(other, "b.jpg")), "top_k=3&logits=true"),
        request(plain, "tasks=acme-one,base&top_k=2&logits=0&unknown=1"),
        request(plain, "tasks=acme-one&tasks=other"),
        request(plain, "tasks=nope"),
        request(plain, "tasks="),
        request(plain, "top_k=0"),
        request(plain, "top_k=1001"),
        request(plain, "top_k=abc"),
        request(plain, "top_k=2&top_k=3"),
        request(plain, "top_k=+2"),
        request(plain, "logits=maybe"),
        request(plain, "logits=yes"),
        request(body(part(one, name="file"))),
        request(body(part(one), part(b"x", filename=None, name="note"))),
        request(body(part(one, filename=None))),
        request(body(part(one, filename="caf\u00e9.jpg".encode().decode("latin-1")))),
        request(body(part(one, filename=""))),
        request(body(part(one, extra="Content-Type: image/jpeg\r\n"))),
        request(body(part(one, extra="X-Other: 1\r\n"))),
        request(body(part(one), preamble=b"a preamble\r\n")),
        request(body(part(one), epilogue=b"an epilogue")),
        request(plain, content_type=f'multipart/form-data; boundary="{B}"'),
        request(plain, content_type=f"multipart/form-data; charset=utf-8; boundary={B}"),
        request(plain, chunked=True),
        request(json.dumps({"image": "x"}).encode(), content_type="application/json"),
        request(plain, content_type=""),
        request(body(*[part(one)] * 17)),
        request(body(part(b""))),
        request(body(part(b"just some text, no image here"))),
        request(body(part(b"\xff\xd8\xff\xe0 a JPEG that stops here"))),
        request(plain[:-10]),
        request(b"not multipart at all"),
        request(plain, length=10**9),
        request(plain, host="evil.example"),
        request(plain, auth="not-a-key"),
        request(plain, auth=keys["acme"]),
        request(plain, "tasks=other", auth=keys["acme"]),
        request(plain, "tasks=acme-one", auth=keys["acme"]),
        request(body(*[part(one)] * 3), auth=keys["limited"]),  # over its burst: 413
        request(plain, auth=keys["limited"]),  # one of its two tokens
        request(body(part(one), part(one)), auth=keys["limited"]),  # 429 when charged
        *[request(plain, auth=keys["limited"]) for _ in range(2)],  # its last token, then 429 at once
        request(plain, auth=TOKEN),
        request(plain, method="GET"),
        request(plain, path="/classify/"),
        request(plain, path="/classify?"),
    ]


def test_the_raw_route_answers_as_fastapi_does(servers) -> None:
    raw, general, keys = servers
    statuses = set()
    for i, case in enumerate(cases(keys)):
        got = exchange(raw, case)
        assert got == exchange(general, case), (i, case[:300])
        statuses.add(int(got[9:12]))
    assert statuses == {200, 307, 400, 403, 405, 413, 415, 422, 429}  # the cases cover what they should
    gone = request(body(part(jpeg())), length=5000)  # the client leaves before its body is complete
    assert exchange(raw, gone, leave=True) == exchange(general, gone, leave=True)


def _classify_counts(url: str) -> dict[str, float]:
    with socket.create_connection(tuple(url.removeprefix("http://").split(":"))) as s:  # type: ignore[arg-type]
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    found = re.findall(
        r'^memvit_requests_total\{method="POST",route="/classify",status="(\d+)"\} (\S+)$', text, re.M
    )
    return {status: float(n) for status, n in found}


def test_the_metrics_count_the_same(servers) -> None:
    raw, general, keys = servers
    assert _classify_counts(raw) == _classify_counts(general)  # after the test above, in file order
    posts = [c for c in cases(keys) if re.match(rb"POST /classify[ ?]", c)]
    assert sum(_classify_counts(raw).values()) == len(posts) + 1  # and the client that left


class Named:
    """A middleware added after ``create_app``, as a Ray replica adds its own (server/ray/serve.py)."""

    def __init__(self, app, name: str) -> None:
        self.app, self.name = app, name.encode()

    async def __call__(self, scope, receive, send) -> None:
        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-named", self.name)]}
            await send(message)

        await self.app(scope, receive, named)


def test_middleware_added_after_the_app_wraps_the_raw_route_too(tiny_weights, tmp_path) -> None:
    settings = Settings(weights=tiny_weights, adapter_store=tmp_path / "store", port=free_port())
    app = create_app(settings)
    app.add_middleware(Named, name="replica-7")
    with running_server(settings, app) as url:
        for case in (request(body(part(jpeg()))), request(b"{}", content_type="application/json")):
            assert b"\r\nx-named: replica-7\r\n" in exchange(url, case)
