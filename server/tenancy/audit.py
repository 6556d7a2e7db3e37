"""The audit trail: one line, and one count, for every attempt to change the adapter set.

The guard opens an ``AuditEntry`` for every request to a state-changing route (the route table's
``changes_state``) and records it once the answer is sent, whatever answered it: the guard's own
refusals (host, origin, credentials, caps), FastAPI's (415, 422), the route's (a name the key does not
cover, a conflict) and success. The route fills in what only it learns: the bundle's name and the
sha256 of the uploaded bytes, or of the adapter deleted.

- the log line, on logger ``memvit.audit``::

      time=2026-01-05T10:00:00Z action=register name=acme-cats key=acme sha256=9f86... result=201

  ``key`` is the caller's id (a key's id, ``admin`` or ``anonymous``): never the key or its hash.
- the counter ``memvit_adapter_changes_total{action, result}``: ``action`` is register, replace or
  delete; ``result`` is the HTTP status the client got (``201``, ``403``, ...), or ``none`` when no
  answer was sent (the client left). Names are never labels: they are unbounded and per tenant.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

from ..telemetry.metrics import Metrics

log = logging.getLogger("memvit.audit")
_PLAIN = re.compile(r"^[A-Za-z0-9._*-]{1,128}$")


@dataclass
class AuditEntry:
    action: str  # register | replace | delete
    name: str = "-"
    key: str = "-"
    sha256: str = "-"


def action_of(method: str, query_string: bytes) -> str:
    """register, replace (POST with ``?replace=true``) or delete."""
    if method == "DELETE":
        return "delete"
    replace = parse_qs(query_string.decode("latin-1")).get("replace", ["false"])[-1]
    return "replace" if replace.strip().lower() in ("true", "1", "yes", "on") else "register"


def _shown(value: str) -> str:
    # A name from the path is whatever the client sent: quoted and escaped unless it is plain, so a
    # newline cannot forge a second line.
    return value if _PLAIN.match(value) else json.dumps(value)


def record(entry: AuditEntry, result: str, metrics: Metrics | None) -> None:
    """Logs ``entry`` with its result and counts it."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    log.info(
        "time=%s action=%s name=%s key=%s sha256=%s result=%s",
        now, entry.action, _shown(entry.name), _shown(entry.key), entry.sha256, result,
    )  # fmt: skip
    if metrics is not None:
        metrics.adapter_changes.labels(entry.action, result).inc()
