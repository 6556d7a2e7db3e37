"""A closed-loop HTTP load generator that costs the shared cores as little as it can.

The server and its clients share this machine's cores, so every millisecond the load generator
spends is taken from the server. An HTTP library spends a few milliseconds of CPU per upload
(measured with httpx: ~2 ms per 300 kB photo, about as much as the server's own HTTP work); a socket
write of a request prepared in advance costs almost nothing. ``load`` reports the generator's own
CPU per request so that a reader can see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field

BOUNDARY = "memvit-bench-boundary"


def multipart_body(data: bytes, name: str, field_name: str = "image") -> bytes:
    """One file upload as a ``multipart/form-data`` body with ``BOUNDARY``."""
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field_name}"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def classify_requests(host: str, port: int, images: list[bytes]) -> list[bytes]:
    """One complete ``POST /classify?top_k=1`` HTTP/1.1 request per photo (multipart, field ``image``)."""
    requests = []
    for i, data in enumerate(images):
        body = multipart_body(data, f"photo-{i}")
        head = (
            f"POST /classify?top_k=1 HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    return requests


class RawHttpClient:
    """One keep-alive HTTP/1.1 connection: writes prepared requests, reads status and body.

    Responses must carry Content-Length (every memvit response does).
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawHttpClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    async def send(self, request: bytes) -> int:
        """Send one prepared request; returns the response's status once its body is read."""
        return (await self.exchange(request))[0]

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one prepared request; returns the response's status and body. A response that closes
        the connection (``connection: close``) has this client reconnect for the next request."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lines = head.lower().split(b"\r\n")
        lengths = [int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")]
        if not lengths:
            raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
        body = await self.reader.readexactly(lengths[0])
        if b"connection: close" in lines:
            self.writer.close()
        return status, body


@dataclass
class LoadResult:
    clients: int
    requests: int  # sent in the steady-state window
    completed: int  # all requests, ramp-up and tail included
    throughput: float  # images/s: clients / mean latency
    p50_ms: float
    p99_ms: float
    statuses: dict[int, int]  # of all requests
    client_cpu_ms: float  # the load generator's own CPU per request
    admin: dict[int, int] = field(default_factory=dict)  # statuses of hot registrations, if any


async def load(
    host: str,
    port: int,
    requests: list[bytes],
    clients: int,
    seconds: float,
    *,
    hot_bundle: bytes | None = None,
    admin_interval: float = 0.25,
    rate: float | None = None,
) -> LoadResult:
    """``clients`` closed-loop clients; figures from requests sent in a steady-state window.

    The window is [start + seconds / 4, start + seconds): the first quarter is ramp-up (the pipeline
    fills, batches form). Clients keep sending after the window closes until every request sent in
    it has been answered, so each of those was served with all ``clients`` at work, never by a
    draining system. Throughput comes from the interactive response time law of a closed system,
    X = N / (R + Z): N clients, R the mean latency of the window's requests, Z a client's own time
    between a response and its next request (microseconds here). Counting completions in a window
    instead is quantised by batches: with 32 images finishing together every few seconds, a 15 s
    window holds 4 or 5 of them, a 20% swing. With ``hot_bundle``, another client registers it
    (``replace=true``) and deletes it every ``admin_interval`` seconds meanwhile.

    ``rate``: offered requests per second, in all; each client then sends one request every
    ``clients / rate`` seconds (later if its previous answer is late), so the server sees that load
    rather than as much as it can take, and throughput is the answers counted in the window.
    """
    window: list[float] = []  # latency of each request sent inside the window
    statuses: dict[int, int] = {}
    admin: dict[int, int] = {}
    cpu0, start = time.process_time(), time.perf_counter()
    window_start, deadline = start + seconds / 4, start + seconds
    open_in_window = 0  # requests sent before the deadline and not yet answered
    finished = asyncio.Event()  # every request sent before the deadline has its answer
    sent = 0

    async def client(i: int) -> None:
        nonlocal open_in_window, sent
        async with RawHttpClient(host, port) as http:
            n = i
            period = clients / rate if rate else 0.0
            next_send = start + (i / clients) * period  # clients spread over one period
            while not finished.is_set():
                request = requests[n % len(requests)]
                n += 1
                if period:
                    await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
                    next_send += period
                began = time.perf_counter()
                counted = began < deadline
                open_in_window += counted
                status = await http.send(request)
                ended = time.perf_counter()
                sent += 1
                statuses[status] = statuses.get(status, 0) + 1
                if counted:
                    open_in_window -= 1
                    if began >= window_start:
                        window.append(ended - began)
                if ended >= deadline and open_in_window == 0:
                    finished.set()

    async def registrations() -> None:
        import httpx  # here: a load worker (benchmarks/load_procs.py) imports this module and not httpx

        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=120) as http:
            while not finished.is_set():
                files = {"bundle": ("hot.safetensors", hot_bundle)}
                r = await http.post("/adapters", files=files, params={"replace": True})
                admin[r.status_code] = admin.get(r.status_code, 0) + 1
                await asyncio.sleep(admin_interval)
                r = await http.delete("/adapters/hot")
                admin[r.status_code] = admin.get(r.status_code, 0) + 1
                await asyncio.sleep(admin_interval)

    tasks = [client(i) for i in range(clients)]
    if hot_bundle is not None:
        tasks.append(registrations())
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu0
    if len(window) < 2:
        raise RuntimeError(f"only {len(window)} requests in the window: run longer than {seconds}s")
    q = statistics.quantiles(window, n=100)
    # Paced, a client spends most of its time waiting to send: the window's count is the throughput.
    throughput = len(window) / (deadline - window_start) if rate else clients / statistics.fmean(window)
    return LoadResult(
        clients=clients,
        requests=len(window),
        completed=sent,
        throughput=throughput,
        p50_ms=1e3 * statistics.median(window),
        p99_ms=1e3 * q[98],
        statuses=statuses,
        client_cpu_ms=1e3 * cpu / max(sent, 1),
        admin=admin,
    )
