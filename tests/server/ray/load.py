"""Load on the Ray cluster while something is lost, and requests a replica is known to hold when it
is: what the loss tests (test_serve_losses.py) check the 503 + Retry-After of a lost request with."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from dataclasses import dataclass

import httpx

from memvit.server.ray.serve import REPLICA_HEADER
from memvit.server.registry import Catalog
from memvit.server.store import open_store
from tests.server.ray.cluster import (
    ADAPTER,
    CLIENTS,
    LOSS_WINDOW,
    Cluster,
    Expected,
    _classify,
    _nothing_to_migrate,
    _wait,
)


# -- load while something is lost ------------------------------------------------------------------
@dataclass
class Outcome:
    started: float
    ended: float
    status: int | str  # an HTTP status, or the transport error's name
    retry_after: str | None = None
    replica: str | None = None
    adapters: tuple[str, ...] = ()
    error: str | None = None  # the error body's type
    problem: str | None = None


class Load:
    """CLIENTS threads classifying through the proxy, every answer checked; bounded in time and count."""

    def __init__(self, cluster: Cluster, max_seconds: float = 150.0, max_requests: int = 50_000) -> None:
        self.cluster = cluster
        self.deadline = time.monotonic() + max_seconds
        self.max_requests = max_requests
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _run(self, seed: int) -> None:
        expected = self.cluster.expected
        with httpx.Client() as client:
            i = seed
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                if len(self.outcomes) >= self.max_requests:
                    return
                index = i % len(expected.images)
                i += 1
                started = time.monotonic()
                try:
                    r = _classify(client, self.cluster.url, expected, index)
                except httpx.TransportError as exc:
                    self.outcomes.append(Outcome(started, time.monotonic(), type(exc).__name__))
                    continue
                outcome = Outcome(
                    started, time.monotonic(), r.status_code, r.headers.get("retry-after"),
                    r.headers.get(REPLICA_HEADER),
                )  # fmt: skip
                try:
                    body = r.json()
                    if r.status_code == 200:
                        outcome.adapters = tuple(body["tasks"])
                        outcome.problem = expected.problem(body, index)
                    elif "error" not in body:
                        outcome.problem = f"{r.status_code} without the service's error body"
                    else:
                        outcome.error = body["error"]["type"]
                except (ValueError, KeyError, IndexError) as exc:  # not the service's JSON at all
                    outcome.problem = f"{r.status_code} {r.text[:200]!r}: {exc!r}"
                self.outcomes.append(outcome)

    def wait_for(self, condition, timeout: float, what: str) -> Outcome:
        """The first outcome that meets ``condition`` (waiting for it while the load runs)."""

        def found() -> Outcome | None:
            return next((o for o in list(self.outcomes) if condition(o)), None)

        return _wait(found, timeout, what, 0.1)


def _check_losses(outcomes: list[Outcome], lost_at: float) -> dict[str, object]:
    """Every answer right, or a 503 with Retry-After within LOSS_WINDOW of the loss; nothing else."""
    other = [o for o in outcomes if o.status not in (200, 503)]
    assert not other, f"answers other than 200/503 (transport errors included): {other[:5]}"
    wrong = [o for o in outcomes if o.problem]
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[0]}"
    refused = [o for o in outcomes if o.status == 503]
    loading = [o for o in refused if o.error == "NotReadyError"]
    assert not loading, f"Serve routed to a replica still loading: {loading[:3]}"
    assert all(o.retry_after for o in refused), f"503 without Retry-After: {refused[:5]}"
    late = [o for o in refused if not lost_at <= o.ended <= lost_at + LOSS_WINDOW]
    assert not late, f"503s outside {LOSS_WINDOW}s of the loss: {[round(o.ended - lost_at, 2) for o in late]}"
    # Each client has one request in flight: only those on the lost replica can fail; others reroute.
    assert len(refused) <= CLIENTS, f"{len(refused)} 503s for {CLIENTS} clients"
    return {
        "requests": len(outcomes),
        "503s": len(refused),
        "503_at_s": [round(o.ended - lost_at, 2) for o in refused],
    }


def _serves_adapter(o: Outcome) -> bool:
    return o.status == 200 and ADAPTER in o.adapters and o.problem is None


def _replacement_serving(cluster: Cluster, load: Load, before: dict[str, dict]) -> Outcome:
    """The first answer from a replica started after ``before`` that serves ADAPTER. If none comes,
    the error says where each replica's registry stands against the bucket's: a replica behind the
    bucket did not pick the registry up; a bucket without ADAPTER was never given it."""
    try:
        return load.wait_for(
            lambda o: o.replica not in before and _serves_adapter(o), 120, "a replacement replica serving"
        )
    except TimeoutError as exc:
        stored = Catalog(open_store(cluster.store))
        stored.open(_nothing_to_migrate, max_bytes=1 << 26)
        replicas = {r: info["registry"] for r, info in cluster.describe().items()}
        raise TimeoutError(
            f"{exc}; the bucket: v{stored.version} {sorted(stored.state.adapters)}; the replicas: {replicas}"
        ) from None


# -- requests a replica is known to hold when it is lost -------------------------------------------
class HeldRequest:
    """A /classify whose body stops halfway: the replica Serve gave it waits for the rest, so it is
    in flight there for as long as we like (a raw socket: no client library waits for a response
    before the body is sent)."""

    def __init__(self, url: str, expected: Expected, index: int) -> None:
        self.expected, self.index = expected, index
        host, port = url.removeprefix("http://").split(":")
        boundary = f"memvit-held-{index}"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="held.jpg"\r\n'
                "Content-Type: image/jpeg\r\n\r\n"
            ).encode()
            + expected.images[index % len(expected.images)]
            + f"\r\n--{boundary}--\r\n".encode()
        )
        head = (
            f"POST /classify?logits=true HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        half = len(body) // 2
        self.rest = body[half:]
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(head + body[:half])

    def answered_early(self, timeout: float) -> bool:
        """Whether a response arrives before the body is complete (its replica was lost)."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def finish(self, early: bool) -> Outcome:
        """Sends the rest of the body unless answered early; the response, checked."""
        with self.sock:
            started = time.monotonic()
            if not early:
                self.sock.sendall(self.rest)
            response = http.client.HTTPResponse(self.sock)
            response.begin()
            data = response.read()
        outcome = Outcome(started, time.monotonic(), response.status, response.getheader("retry-after"))
        try:
            body = json.loads(data)
            if response.status == 200:
                outcome.adapters = tuple(body["tasks"])
                outcome.problem = self.expected.problem(body, self.index % len(self.expected.images))
            else:
                outcome.error = body["error"]["type"]
        except (ValueError, KeyError) as exc:
            outcome.problem = f"{response.status} {data[:200]!r}: {exc!r}"
        return outcome


def _hold(cluster: Cluster, target: str, at_most: int = 12) -> tuple[list[HeldRequest], int]:
    """Held requests until replica ``target`` holds at least one (Serve picks the replica; with no
    other traffic, each replica's count of requests in flight says where they went)."""
    held: list[HeldRequest] = []
    while len(held) < at_most:
        held.append(HeldRequest(cluster.url, cluster.expected, len(held)))
        counts = _wait(
            lambda: (lambda c: c if sum(c.values()) == len(held) else None)(
                {r: info["in_flight"] for r, info in cluster.describe().items()}
            ),
            20,
            "every held request reaching a replica",
        )
        if counts.get(target, 0) >= 1 and len(held) >= 2:
            return held, counts[target]
    raise AssertionError(f"{at_most} requests and none went to {target}")


def _release(held: list[HeldRequest], on_lost: int, lost_at: float) -> float:
    """After a loss: the requests the lost replica held are answered at once, 503 + Retry-After;
    the others are completed and answered rightly by the replica that holds them. Returns how long
    after the loss the last 503 came."""
    early: dict[int, float] = {}  # held request -> when its answer came
    deadline = lost_at + LOSS_WINDOW
    while len(early) < on_lost and time.monotonic() < deadline:
        for i, h in enumerate(held):
            if i not in early and h.answered_early(0.02):
                early[i] = time.monotonic()
    time.sleep(0.5)  # room for a wrong early answer from a replica that was not lost
    early |= {i: time.monotonic() for i, h in enumerate(held) if i not in early and h.answered_early(0)}
    outcomes = [h.finish(i in early) for i, h in enumerate(held)]
    lost = [outcomes[i] for i in sorted(early)]
    assert len(lost) == on_lost, f"{on_lost} requests were on the lost replica, {len(lost)} answered early"
    assert all(o.status == 503 and o.retry_after and o.error for o in lost), lost
    kept = [o for i, o in enumerate(outcomes) if i not in early]
    assert all(o.status == 200 and o.problem is None for o in kept), kept
    return max(early.values()) - lost_at
