"""``memvit usage``: requests, images and adapter rows per key, task and day, from the adapter store.

memvit usage                                    # today (UTC), every key, per task
memvit usage --since 2026-11-01 --until 2026-11-30 --key acme
memvit usage --since 2026-11-01 --totals        # per key: requests, images, adapter rows
memvit usage --store s3://bucket/adapters       # default: $MEMVIT_ADAPTER_STORE

Reads the usage log every replica writes beside the adapters (server/tenancy/usage_log.py), as ``GET /usage``
does: it covers each replica up to its last written interval.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated

import typer

from .common import fail

Day = Annotated[
    datetime.datetime | None,
    typer.Option(formats=["%Y-%m-%d"], help="a UTC day, YYYY-MM-DD (default: today)"),
]


def usage(
    store: Annotated[
        str,
        typer.Option(
            envvar="MEMVIT_ADAPTER_STORE", help="the adapter store (default: $MEMVIT_ADAPTER_STORE)"
        ),
    ] = "adapter-store",
    since: Day = None,
    until: Day = None,
    key: Annotated[str | None, typer.Option(help="one key's id (admin and anonymous included)")] = None,
    totals: Annotated[
        bool, typer.Option("--totals", help="per key over the days: requests, images, rows")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table")] = False,
) -> None:
    """Usage per key, task and day: requests and images (base), requests and rows (each adapter)."""
    from ..store import is_object_url, open_store
    from ..tenancy.usage import BASE_TASK, summarize
    from ..tenancy.usage_log import LocalUsageLog, usage_log_for

    today = datetime.datetime.now(datetime.timezone.utc).date()
    last = until.date() if until else today
    first = since.date() if since else min(last, today)
    try:
        if is_object_url(store):
            usage_log = usage_log_for(open_store(store))
        else:  # a folder is only read: never created here
            usage_log = LocalUsageLog(Path(store.removeprefix("file://")))
        rows = summarize(usage_log, first, last, None if key is None else key.__eq__)
    except Exception as exc:  # a bad range, an unreadable folder, an unreachable bucket: one line, exit 2
        raise fail(exc) from None
    if totals:
        per_key: dict[str, list[int]] = {}
        for row in rows:
            tally = per_key.setdefault(row.key, [0, 0, 0])
            if row.task == BASE_TASK:
                tally[0] += row.requests
                tally[1] += row.images
            else:
                tally[2] += row.images
        table = [
            {"key": k, "requests": r, "images": i, "adapter_rows": a}
            for k, (r, i, a) in sorted(per_key.items())
        ]
    else:
        table = [
            {"day": r.day, "key": r.key, "task": r.task, "requests": r.requests, "images": r.images}
            for r in rows
        ]
    if as_json:
        for entry in table:
            typer.echo(json.dumps(entry))
        return
    columns = (
        ["key", "requests", "images", "adapter_rows"]
        if totals
        else ["day", "key", "task", "requests", "images"]
    )
    typer.echo("\t".join(columns))
    for entry in table:
        typer.echo("\t".join(str(entry[c]) for c in columns))
    if not table:
        typer.echo(f"no usage recorded from {first} to {last} in {usage_log.location}", err=True)
