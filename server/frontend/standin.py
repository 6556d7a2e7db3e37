"""The group's answer on its port while none of its processes can take traffic.

An API process or a replica listens on the shared port only once it can answer (api_process.py):
with ``SO_REUSEPORT`` the kernel hands each connection to one of the listening processes without
asking whether it is ready, so a process still loading would answer its share "not ready" while
another process stands ready (the H200 run: 426 x 503 at the start of a load). Until one process
listens, something must still answer the port: a Kubernetes liveness probe that finds it closed for
the length of a long load restarts the pod, and a client should be told to retry rather than be
refused. The supervisor answers then, with ``StandIn``, as one process answers while it loads:

- ``GET /healthz`` 200 and ``GET /v2/health/live`` 200 (alive: the group is starting);
- ``GET /readyz``, ``GET /v2/health/ready`` and every other request 503 with ``Retry-After: 1``,
  in the bodies a loading process gives;
- each answer closes its connection, so a client's next request reaches whoever listens then.

The supervisor calls ``update`` as its processes come and go; the stand-in also asks ``serving`` at
each request it reads. Once a process listens, the stand-in stops listening (its socket leaves the
port's group), and the connections it had accepted or found waiting in its queue are passed on to
the port, now served by the processes that are ready: none is answered "not ready" by the stand-in
while a process is ready. (Linux resets the connections that reach a listening socket's queue in the
microseconds between the last accept and the close; ``net.ipv4.tcp_migrate_req=1`` hands those to
another listener instead.) Should every process stop listening (all died at once), it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("memvit.server.supervisor")
HEAD_LIMIT, HEAD_SECONDS = 65536, 10.0
LOADING = "the model and the adapter store are still loading"
_HEALTHZ = json.dumps({"status": "alive", "detail": None}, separators=(",", ":")).encode()
_READYZ = json.dumps({"status": "loading", "detail": LOADING}, separators=(",", ":")).encode()
_NOT_READY = {"type": "NotReadyError", "message": f"{LOADING}; retry shortly"}
_ERROR = json.dumps({"error": _NOT_READY}, separators=(",", ":")).encode()
_PROTOCOL_ERROR = json.dumps({"error": _NOT_READY["message"]}).encode()  # server/oip/errors.py's shape


def answer(method: str, path: str) -> bytes:
    """The response a loading process gives to ``method path`` (no Date header: not an app's)."""
    path = path.split("?", 1)[0]
    if method == "GET" and path == "/healthz":
        return _response(b"200 OK", _HEALTHZ, b"application/json", retry=False)
    if method == "GET" and path == "/v2/health/live":
        return _response(b"200 OK", b"", None, retry=False)
    if method == "GET" and path == "/readyz":
        return _response(b"503 Service Unavailable", _READYZ, b"application/json")
    if path == "/v2" or path.startswith("/v2/"):
        return _response(b"503 Service Unavailable", _PROTOCOL_ERROR, b"application/json")
    return _response(b"503 Service Unavailable", _ERROR, b"application/json")


def _response(status: bytes, body: bytes, kind: bytes | None, *, retry: bool = True) -> bytes:
    head = [b"HTTP/1.1 " + status, b"server: memvit"]
    head += [b"retry-after: 1"] if retry else []
    head += [b"content-length: %d" % len(body)]
    head += [b"content-type: " + kind] if kind else []
    return b"\r\n".join([*head, b"connection: close", b"", b""]) + body


class StandIn:
    """Answers on ``host:port`` (``SO_REUSEPORT``) while ``serving()`` is false; see the module's doc.
    Runs its own event loop on a thread of the supervisor."""

    def __init__(self, host: str, port: int, serving: Callable[[], bool]) -> None:
        self.host, self.port, self.serving = host, port, serving
        self.target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        self.loop = asyncio.new_event_loop()
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="stand-in", daemon=True)

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        self._thread.start()
        self.update()

    def update(self) -> None:
        """Listen if no process serves the port, stop if one does (from any thread)."""
        self.loop.call_soon_threadsafe(self._update)

    def close(self) -> None:
        """Stops answering, ends the connections it holds, and its thread."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    async def _close(self) -> None:
        self._stop_listening(drain=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _update(self) -> None:
        serving = self.serving()
        if serving and self._sock is not None:
            self._stop_listening()
        elif not serving and self._sock is None:
            self._listen()

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = self.loop.create_task(self._accept(sock))
        log.info("no process listens on port %d yet: the stand-in answers there", self.port)

    def _stop_listening(self, drain: bool = True) -> None:
        """Out of the port's group; what waits in its queue is served (passed on) first."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._accepting is not None:
            self._accepting.cancel()
        self.loop.remove_reader(sock)  # now, not when the task sees its cancellation: the fd is reused
        if drain:
            log.info("a process listens on port %d: the stand-in stops answering there", self.port)
        while drain:
            try:
                conn, _ = sock.accept()
            except OSError:  # BlockingIOError: the queue is empty
                break
            self._spawn(conn)
        sock.close()

    async def _accept(self, sock: socket.socket) -> None:
        while True:
            conn, _ = await self.loop.sock_accept(sock)
            self._spawn(conn)

    def _spawn(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        task = self.loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=conn)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_SECONDS)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, OSError):
                return
            if self.serving() and await self._pass_on(head, reader, writer):
                return
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0].decode("latin-1")
            writer.write(answer(method.decode("latin-1"), path))
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _pass_on(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The connection, from ``head`` on, to a process that listens now; False if none answers."""
        if self._sock is not None:
            self._stop_listening()  # else the connection could come back here
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target, self.port)
        except OSError:
            return False
        up_writer.write(head)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            with contextlib.suppress(OSError):
                sink.write_eof()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            up_writer.close()
        return True
