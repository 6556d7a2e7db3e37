"""GET /usage: requests, images and adapter rows per key, task and day, as written by every replica.

A key sees its own usage; the admin every key's (``?key=`` picks one). Read from the usage log beside
the adapters (server/tenancy/usage_log.py), so it covers every replica sharing the store, up to each one's
last written interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from ..edge.principal import Kind
from ..errors import ForbiddenError, InvalidParameterError, NotRecordedError, ServiceError
from ..http.deps import PrincipalDep, SettingsDep, StateDep, service_of
from ..http.openapi import errors
from ..http.schemas import UsageEntry, UsageReport
from ..tenancy.usage import summarize

router = APIRouter(tags=["usage"])
# A string, not a date: pydantic would take "0" for 1970-01-01.
Day = Annotated[
    str | None, Query(pattern=r"^\d{4}-\d{2}-\d{2}$", description="a UTC day, YYYY-MM-DD (default: today)")
]


def _day(value: str | None, name: str) -> datetime.date | None:
    try:
        return None if value is None else datetime.date.fromisoformat(value)
    except ValueError:
        raise InvalidParameterError(f"{name}: {value!r} is not a day (YYYY-MM-DD)", field=name) from None


@router.get(
    "/usage",
    response_model=UsageReport,
    responses=errors(400, 401, 403, 404, 422, 503),
    summary="Usage per key, task and day",
)
async def usage(
    state: StateDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    since: Day = None,
    until: Day = None,
    key: Annotated[str | None, Query(description="one key's id (a key sees only its own)")] = None,
) -> UsageReport:
    service = service_of(state)
    if service.usage.log is None:
        raise NotRecordedError("usage is not recorded on this server (MEMVIT_USAGE_LOG=false)")
    if principal.kind is Kind.KEY:
        if key is not None and key != principal.id:
            raise ForbiddenError(f"this key may read only its own usage ({principal.id!r})", field="key")
        key = principal.id
    today = datetime.datetime.now(datetime.timezone.utc).date()
    last = _day(until, "until") or today
    first = _day(since, "since") or min(last, today)
    try:
        rows = await asyncio.to_thread(
            summarize, service.usage.log, first, last, None if key is None else key.__eq__
        )
    except ValueError as exc:  # the range: reversed, or too long
        raise ServiceError(str(exc), field="since") from None
    return UsageReport(
        since=first.isoformat(),
        until=last.isoformat(),
        written_every_seconds=settings.usage_interval_seconds,
        usage=[UsageEntry(**dataclasses.asdict(row)) for row in rows],
    )
