"""Calls between the API processes and the model process: one Unix socket each, framed messages, any
number of calls in flight, answered in any order.

A frame is a 4-byte length and a pickle: ``(call id, method, args, kwargs)`` one way, ``(call id,
ok, result)`` the other, or a batch's answers to one API process in one frame (``BATCH``). The
model process's side reads and writes on threads of its own (no event loop on the data path); an
API process's side is its event loop's. Both ends are this package's own processes, started
together by one supervisor (server/frontend/), on a socket in a directory only they can reach;
large payloads (the uploads) go through shared memory (server/frontend/shm_arena.py) and only their
tickets through here. An error raised by a handler comes back as the same exception class with the
same message and field,
so an API process answers it exactly as the model process would have (server/errors.py).

Here: the frames, the errors and the model process's side (``LinkServer``); the API process's side is
``LinkClient`` (link_client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import pickle
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import RetryLaterError
from ..telemetry.os_names import os_named

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("!I")
Handler = Callable[..., Awaitable[Any]]
NOTIFY = -1  # the call id of a call nobody waits for
BATCH = -2  # the call id of answers sent as one frame: (BATCH, True, [(call id, ok, result), ...])
# Which connection a handler is serving (set per connection; tasks inherit it): state a handler keeps
# for one API process (its admitted requests, its images on their way) is dropped when it goes away.
current_peer: contextvars.ContextVar[int] = contextvars.ContextVar("current_peer", default=-1)


class LinkDownError(RetryLaterError):
    """The model process is not answering (starting, restarting or gone): 503 with Retry-After."""


async def _read(reader: asyncio.StreamReader) -> Any:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(n))


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def _pack_error(exc: BaseException) -> tuple[type, tuple, dict]:
    """An exception as its class, args and attributes (``field``): pickling an exception keeps only
    its args, and ours carry more."""
    return type(exc), exc.args, {k: v for k, v in vars(exc).items() if not k.startswith("_")}


def _unpack_error(packed: tuple[type, tuple, dict]) -> BaseException:
    kind, args, attributes = packed
    exc = kind.__new__(kind)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc


class Connection:
    """One API process's connection, in the model process. Answers leave from the thread that has
    them when the socket takes them at once (a non-blocking send: no hand-off to another thread per
    batch); whatever it does not take, or what comes while another thread is sending, goes through
    the writer thread, which may block. Frames leave in the order they were sent either way."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        self._out: list[bytes] = []
        self._ready = threading.Condition()
        self._sending = False  # a thread (the writer, or a sender) is writing to the socket now
        self._closed = False
        self._writer = threading.Thread(
            target=os_named(f"link-write-{peer}", self._write), name=f"link-write-{peer}", daemon=True
        )
        self._writer.start()

    def answer(self, call_id: int, ok: bool, result: Any) -> None:
        if call_id >= 0:  # a notification (NOTIFY) is answered by nobody
            self.send([_frame((call_id, ok, result))])

    def fail(self, call_id: int, exc: BaseException) -> None:
        if not getattr(exc, "expected", False) and getattr(exc, "status", 500) >= 500:
            log.error("link call failed", exc_info=exc)
        self.answer(call_id, False, _pack_error(exc))

    def failure(self, call_id: int, exc: BaseException) -> bytes:
        """The frame that answers ``call_id`` with ``exc`` (to send with others)."""
        return _frame(self.failed(call_id, exc))

    def failed(self, call_id: int, exc: BaseException) -> tuple:
        """The answer to ``call_id`` that raises ``exc`` there, to frame (alone, or in a ``BATCH``)."""
        if not getattr(exc, "expected", False) and getattr(exc, "status", 500) >= 500:
            log.error("link call failed", exc_info=exc)
        return call_id, False, _pack_error(exc)

    def send(self, frames: list[bytes]) -> None:
        with self._ready:
            if self._closed:
                return
            if self._sending or self._out:  # behind what is being written: the writer sends it
                self._out.extend(frames)
                self._ready.notify()
                return
            self._sending = True
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        try:
            sent = self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:  # the socket's buffer is full: the writer waits for room
            sent = 0
        except OSError:  # the API process went away: its reader says so
            sent = len(data)
        with self._ready:
            self._sending = False
            if sent < len(data):
                self._out.insert(0, data[sent:])  # before anything queued meanwhile
            if self._out:
                self._ready.notify()

    def _write(self) -> None:
        while True:
            with self._ready:
                while (not self._out or self._sending) and not self._closed:
                    self._ready.wait()
                if self._closed and (self._sending or not self._out):
                    return
                data, self._out = b"".join(self._out), []
                self._sending = True
            try:
                self.sock.sendall(data)
            except OSError:  # the API process went away: its reader says so
                return
            finally:
                with self._ready:
                    self._sending = False

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


Inline = Callable[..., None]  # (connection, call id, *args): answers through the connection, later


class LinkServer:
    """The model process's side, on a Unix socket at ``path``: a thread per connection reads its
    frames. A call named in ``inline`` runs on that thread (the data path's calls: they queue work and
    return at once; their answers come later from whichever thread has them); every other handler
    runs on ``loop``, the process's event loop (the control path: registrations, limits). No frame of
    the data path goes through an event loop."""

    def __init__(
        self,
        path: Path,
        handlers: Mapping[str, Handler],
        *,
        loop: asyncio.AbstractEventLoop,
        inline: Mapping[str, Inline] | None = None,
        on_disconnect: Callable[[int], None] | None = None,
    ) -> None:
        """``on_disconnect(peer)``: a connection closed (``current_peer`` named it in its calls)."""
        self.path = Path(path)
        self.handlers, self.inline = dict(handlers), dict(inline or {})
        self.loop, self.on_disconnect = loop, on_disconnect
        self._peers = itertools.count()
        self._listener: socket.socket | None = None
        self._connections: dict[int, Connection] = {}
        self._lock = threading.Lock()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # a socket left by a model process that was killed
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(256)
        self._listener = listener
        accept = os_named("link-accept", self._accept)
        threading.Thread(target=accept, name="link-accept", daemon=True).start()

    async def close(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.close()

    def broadcast(self, method: str, *args: Any, skip: int | None = None) -> list[int]:
        """A notice to every connected API process (but ``skip``); the peers it went to."""
        frame = _frame((NOTIFY, method, args))
        with self._lock:
            connections = [c for peer, c in self._connections.items() if peer != skip]
        for connection in connections:
            connection.send([frame])
        return [c.peer for c in connections]

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            peer = next(self._peers)
            connection = Connection(sock, peer)
            with self._lock:
                self._connections[peer] = connection
            name = f"link-read-{peer}"
            read = os_named(name, self._read)
            threading.Thread(target=read, args=(connection,), name=name, daemon=True).start()

    def _read(self, connection: Connection) -> None:
        sock, buffer = connection.sock, bytearray()
        try:
            while chunk := sock.recv(1 << 20):
                buffer += chunk
                offset = 0
                while len(buffer) - offset >= _LENGTH.size:
                    (n,) = _LENGTH.unpack_from(buffer, offset)
                    end = offset + _LENGTH.size + n
                    if len(buffer) < end:
                        break
                    self._dispatch(connection, pickle.loads(buffer[offset + _LENGTH.size : end]))
                    offset = end
                del buffer[:offset]
        except OSError:
            pass  # the API process went away; its calls in flight find no one to answer
        finally:
            connection.close()
            with self._lock:
                self._connections.pop(connection.peer, None)
            if self.on_disconnect is not None:
                self.on_disconnect(connection.peer)

    def _dispatch(self, connection: Connection, message: tuple) -> None:
        call_id, method, args, kwargs = message
        inline = self.inline.get(method)
        if inline is not None:
            try:
                inline(connection, call_id, *args, **kwargs)
            except Exception as exc:  # answered as itself
                connection.fail(call_id, exc)
            return
        asyncio.run_coroutine_threadsafe(self._call(connection, call_id, method, args, kwargs), self.loop)

    async def _call(
        self, connection: Connection, call_id: int, method: str, args: tuple, kwargs: dict
    ) -> None:
        current_peer.set(connection.peer)  # this call's task: state kept per API process
        try:
            handler = self.handlers[method]
            result = await handler(*args, **kwargs)
        except Exception as exc:  # answered as itself; unexpected ones are logged here too
            connection.fail(call_id, exc)
            return
        connection.answer(call_id, True, result)
