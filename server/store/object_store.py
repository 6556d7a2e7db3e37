"""The adapter store in an object store (``s3://bucket/prefix``; also ``gs://`` and ``az://``).

Talks to the store through obstore (Rust's ``object_store``), which speaks S3, GCS and Azure and
exposes the conditional writes the store interface needs: create-if-absent (``If-None-Match: *``)
and replace-if-unchanged (``If-Match: <etag>``). An object PUT is atomic, so a writer killed
mid-upload leaves the old object or none, never a torn one. Credentials, region and endpoint come
from the standard environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import from_url

from .base import (
    SCHEMES,
    AdapterStore,
    ObjectChangedError,
    ObjectExistsError,
    ObjectTooLargeError,
    ObjectVersion,
    StoreUnavailableError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _version(meta: dict) -> ObjectVersion:
    tag = meta.get("e_tag") or f"{meta['last_modified'].isoformat()}:{meta['size']}"
    return ObjectVersion(str(tag), int(meta["size"]))


class ObjectStore(AdapterStore):
    read_parallelism = 16  # round trips dominate: keep many in flight

    def __init__(self, url: str, *, request_timeout_s: float = 30.0) -> None:
        if not url.startswith(SCHEMES):
            raise ValueError(f"not an object-store URL: {url!r} (expected one of {', '.join(SCHEMES)})")
        self.location = url.rstrip("/")
        # Bounded retries: a store that is down must turn into a clear error, not a 3-minute hang.
        self._store = from_url(
            self.location,
            client_options={
                # Passing client options replaces those read from the environment: keep this one.
                "allow_http": os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"),
                "timeout": datetime.timedelta(seconds=request_timeout_s),
                "connect_timeout": datetime.timedelta(seconds=5),
            },
            retry_config={
                "max_retries": 3,
                "retry_timeout": datetime.timedelta(seconds=request_timeout_s),
                "backoff": {
                    "init_backoff": datetime.timedelta(milliseconds=50),
                    "max_backoff": datetime.timedelta(seconds=2),
                    "base": 2,
                },
            },
        )

    def check(self) -> None:
        """Fail fast (start-up) when the bucket cannot be listed: wrong name, credentials, endpoint."""
        self._list()

    # -- primitives --------------------------------------------------------------------------------
    def _list(self, prefix: str = "") -> dict[str, ObjectVersion]:
        def run() -> dict[str, ObjectVersion]:
            found = {}
            # obstore's prefix is whole path segments: list the folder, then keep the keys that match.
            folder = prefix.rpartition("/")[0] or None
            for batch in obstore.list(self._store, prefix=folder, chunk_size=1000):
                for meta in batch:
                    if meta["path"].startswith(prefix):
                        found[meta["path"]] = _version(meta)
            return found

        return self._call("list", run)

    def _get(self, key: str, max_bytes: int | None = None) -> tuple[bytes, ObjectVersion]:
        def run() -> tuple[bytes, ObjectVersion]:
            result = obstore.get(self._store, key)
            version = _version(result.meta)  # the version of the bytes this GET streams
            if max_bytes is not None and version.size > max_bytes:
                raise ObjectTooLargeError(f"{key} is {version.size} bytes, over the {max_bytes}-byte limit")
            return bytes(result.bytes()), version

        return self._call(f"get {key}", run)

    def _put(self, key: str, data: bytes, *, mode: str | ObjectVersion) -> ObjectVersion:
        put_mode = mode if isinstance(mode, str) else {"e_tag": mode.tag}

        def run() -> ObjectVersion:
            try:
                result = obstore.put(self._store, key, data, mode=put_mode)
            except AlreadyExistsError:
                raise ObjectExistsError(key) from None
            except PreconditionError:
                # If-None-Match on an existing key answers 412 on some stores, 409 on others.
                raise (ObjectExistsError if mode == "create" else ObjectChangedError)(key) from None
            except (NotFoundError, FileNotFoundError):  # If-Match on a key deleted in between
                raise ObjectChangedError(key) from None
            return ObjectVersion(str(result.get("e_tag") or ""), len(data))

        return self._call(f"put {key}", run)

    def _delete(self, key: str) -> None:
        def run() -> None:
            obstore.head(self._store, key)  # S3 deletes are idempotent: look first, to answer 404
            obstore.delete(self._store, key)

        self._call(f"delete {key}", run)

    def _call(self, what: str, run: Callable[[], T]) -> T:
        try:
            return run()
        except (NotFoundError, FileNotFoundError) as exc:  # obstore raises the builtin for a 404
            raise FileNotFoundError(what) from exc
        except (ObjectExistsError, ObjectChangedError, ObjectTooLargeError):
            raise
        except Exception as exc:  # network, credentials, throttling: the store is unavailable
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StoreUnavailableError(
                f"adapter store {self.location}: {what} failed: {first_line}"
            ) from exc
