"""How much a request's body may hold and how long it may take: one receive/send wrapper for both.

- The cap on the whole body (``BodyCap``, per route in routes.py): a Content-Length over it is
  refused by the guard before the app runs; otherwise bytes are counted as ``receive`` hands them
  over, and the request is refused as soon as the count passes the cap (chunked uploads included).
  uvicorn reads the socket only as fast as the app calls ``receive`` (flow control), so nothing much
  past the cap is read into memory or spooled to disk.
- The deadline for the whole body: a total from the start of the request, not a per-chunk idle
  timeout, which trickling one byte at a time would defeat; one timer per request.

Past either, the client gets the refusal (413 or 408, if no response has started yet) with
``connection: close``, so the unread rest of the body is dropped with the connection instead of
being read to keep it alive, and the app sees ``http.disconnect``, as if the client had left; what
the app sends after the refusal is dropped.

``read_upload`` is the per-file cap the routes apply as they read each uploaded file; the whole-body
cap only bounds the request as a whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.datastructures import Headers, UploadFile
from starlette.types import Message, Receive, Send

from ..errors import RequestTimeoutError, RequestTooLargeError, ServiceError

log = logging.getLogger("memvit.server.edge")

# Room for what a multipart body carries besides the files: boundaries, part headers (file names
# included), small form fields. Generous for the few parts these routes take, tiny next to the caps.
MULTIPART_ALLOWANCE = 64 * 1024

Refuse = Callable[[ServiceError], Awaitable[None]]


@dataclass(frozen=True)
class BodyCap:
    """The most bytes a route's whole request body may hold, and what to tell a client over it."""

    limit: int
    why: str

    def error(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"the request body is over the {self.limit}-byte limit: {self.why}")


def content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None  # none (chunked) or unparseable: the streaming count still applies


class BodyLimits:
    """One request's ``receive`` and ``send``, wrapped once: the body's deadline and its byte cap.

    ``refuse(error)`` answers the client; it is called at most once, and only before the app has
    started a response (after that, the app's response stands and the app just sees the disconnect).
    The deadline is one timer for the whole body, armed at the first ``receive`` that waits: at the
    deadline it cancels the task waiting for a chunk, if one is (a ``wait_for`` per chunk would
    create a task and a timer for every chunk of every upload). ``close`` disarms it.
    """

    def __init__(
        self, receive: Receive, send: Send, *, seconds: float, cap: BodyCap | None, refuse: Refuse
    ) -> None:
        self._receive, self._send, self._refuse = receive, send, refuse
        self.cap = cap
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + seconds
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task | None = None  # the task waiting in ``receive`` for a chunk
        self._expired = False
        self._received = 0
        self._body_done = False
        self._cut = False  # the deadline or the cap ended the body: the app sees a disconnect
        self._started = False  # the app started its response
        self._answered = False  # the refusal went out: what the app sends is dropped

    async def receive(self) -> Message:
        if self._body_done:
            return await self._receive()  # after the body, receive() only waits for a disconnect
        if self._cut:
            return {"type": "http.disconnect"}
        if self._expired or self._loop.time() >= self._deadline:
            return await self._late()
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._expire)
        task = self._waiting = asyncio.current_task()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            # Ours (the deadline), unless someone else cancelled the task too: that one goes on.
            if not self._expired or (hasattr(task, "uncancel") and task.uncancel() > 0):
                raise
            return await self._late()
        finally:
            self._waiting = None
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self.cap is not None and self._received > self.cap.limit:
                return await self._cut_off(self.cap.error())
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_done = True
            self.close()
        return message

    @property
    def cut(self) -> bool:
        """Whether the deadline or the cap ended the body (and the refusal answered it)."""
        return self._cut

    async def send(self, message: Message) -> None:
        if self._answered:
            return
        if message["type"] == "http.response.start":
            self._started = True
        await self._send(message)

    def close(self) -> None:
        """The request is over (or its body is read): the deadline's timer goes."""
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _late(self) -> Message:
        return await self._cut_off(RequestTimeoutError("the request body did not arrive in time"))

    async def _cut_off(self, error: ServiceError) -> Message:
        # Stop reading here; to the app the client has left.
        self._cut = True
        self.close()
        if self._started:
            log.debug("request body cut off after the response started: %s", error)
        else:
            self._answered = True
            await self._refuse(error)
        return {"type": "http.disconnect"}


async def read_upload(upload: UploadFile, limit: int, too_large: ServiceError) -> bytes:
    """The bytes of one uploaded file of at most ``limit`` bytes, else ``too_large`` is raised.
    Reads at most one byte past the limit, so an oversized file is never held whole."""
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise too_large
    return data
