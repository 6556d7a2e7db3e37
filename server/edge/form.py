"""A ``/classify`` request read the short way: its query and its multipart body, when they are plain.

FastAPI parses a request's parameters and form with python-multipart and pydantic, in several
layers of Python per request (server/routers/classify_raw.py says what that cost). Nearly every
request is plain: ``multipart/form-data; boundary=...``, files in fields named ``image``, integer and
boolean parameters as clients write them. These functions read exactly that, with ``bytes.find``
over the body, and answer None for anything else (a preamble, another field, an escaped file name, a
parameter FastAPI would refuse or coerce), which then goes FastAPI's way, so that every unusual
request gets FastAPI's own answer. What they accept, they read as FastAPI does; the tests send the
same requests both ways and compare the answers byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

FIELD = "image"
MAX_FILES = 1000  # Starlette's default ``max_files``: past it FastAPI answers 400, so go its way
_CONTENT_TYPE = re.compile(r'multipart/form-data; ?boundary=(?:"([0-9A-Za-z\'()+_,\-./:=? ]{1,70})"'
                           r"|([0-9A-Za-z'()+_,\-./:=?]{1,70}))")  # fmt: skip
_DISPOSITION = re.compile(rb'form-data; ?name="([^"\\\r\n]*)"; ?filename="([ -!#-\[\]-~]*)"')
_TOP_K = re.compile(r"[1-9][0-9]{0,3}")
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


@dataclass(frozen=True)
class Upload:
    """One uploaded file, read: the part of ``UploadFile`` the pipeline uses, without a spooled file."""

    filename: str
    data: bytes

    async def read(self, size: int = -1) -> bytes:
        return self.data if size < 0 else self.data[:size]


@dataclass(frozen=True)
class ClassifyQuery:
    top_k: int = 5
    tasks: list[str] | None = None
    logits: bool = False


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a plain ``multipart/form-data; boundary=...`` content type; None otherwise."""
    found = _CONTENT_TYPE.fullmatch(content_type)
    if found is None:
        return None
    return (found.group(1) or found.group(2)).encode()


def read_files(body: bytes, boundary: bytes) -> list[Upload] | None:
    """The ``image`` files of a plain multipart body; None if it holds anything else or is not plain
    (a preamble, an epilogue, another field, other part headers, a part with no file name)."""
    delimiter = b"--" + boundary
    if not body.startswith(delimiter + b"\r\n"):
        return None
    closing = b"\r\n" + delimiter
    files: list[Upload] = []
    at = len(delimiter) + 2
    while len(files) < MAX_FILES:
        head_end = body.find(b"\r\n\r\n", at)
        if head_end < 0:
            return None
        end = body.find(closing, head_end + 4)
        if end < 0:
            return None
        filename = _file_name(body[at:head_end])
        if filename is None:
            return None
        files.append(Upload(filename, body[head_end + 4 : end]))
        at = end + len(closing)
        after = body[at : at + 2]
        if after == b"--":
            return files if body[at + 2 :] in (b"", b"\r\n") else None
        if after != b"\r\n":
            return None
        at += 2
    return None


def _file_name(head: bytes) -> str | None:
    """The file name of an ``image`` part from its headers, or None if the part is anything else."""
    filename = None
    for line in head.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        name = name.lower()
        if not colon:
            return None
        if name == b"content-disposition" and filename is None:
            found = _DISPOSITION.fullmatch(value.strip())
            if found is None or found.group(1) != FIELD.encode():
                return None
            filename = found.group(2).decode("ascii")
        elif name != b"content-type":
            return None
    return filename


def read_query(query_string: bytes) -> ClassifyQuery | None:
    """``top_k``, ``tasks`` and ``logits`` as FastAPI reads them, when each is plainly valid; None
    otherwise (out of range, repeated, spelled in a way pydantic would coerce or refuse)."""
    if not query_string:
        return ClassifyQuery()
    top_k, logits, tasks = None, None, []
    for key, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
        if key == "top_k":
            if top_k is not None or not _TOP_K.fullmatch(value) or int(value) > 1000:
                return None
            top_k = int(value)
        elif key == "logits":
            if logits is not None or value not in _BOOLEANS:
                return None
            logits = _BOOLEANS[value]
        elif key == "tasks":
            tasks.append(value)
    return ClassifyQuery(5 if top_k is None else top_k, tasks or None, bool(logits))
