"""The adapter resource: list (paged), describe, register (validated, journaled, resident), delete.

Registering and deleting are admin routes: the guard (server/edge/) has checked the caller (a key's
names too, when the path holds one), and capped the body, before these handlers run; a bundle's name
is checked against the key once the registry has parsed it. Every answer names only the adapters the
caller may read, and each change fills in the audit entry the guard opened (server/tenancy/audit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Query, UploadFile

from memvit.adapters import AdapterBundle
from memvit.memory_core import NAME_PATTERN, UnknownAdapterError

from ..edge.access import name_refused
from ..edge.body import read_upload
from ..edge.principal import Principal
from ..errors import BundleTooLargeError
from ..http.deps import AuditDep, PrincipalDep, RegistryDep, SettingsDep, require_multipart
from ..http.openapi import errors
from ..http.schemas import AdapterCreated, AdapterDeleted, AdapterInfo, AdapterList
from ..http.schemas import RegistryInfo as RegistryModel
from ..registry import RegistryInfo
from ..store import Entry

router = APIRouter(prefix="/adapters", tags=["adapters"])
Name = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="adapter name")]


def _info(entry: Entry, training: dict | None = None) -> AdapterInfo:
    """From the registry's entry alone: listing reads no bundle. The model reads the entry's fields by
    name (``from_attributes``), so a field added to both is shown without a line here."""
    info = AdapterInfo.model_validate(entry, from_attributes=True)
    info.training = training
    return info


def _registry(info: RegistryInfo) -> RegistryModel:
    return RegistryModel(version=info.version, adapters=info.adapters)


def _visible_page(
    registry: RegistryDep, principal: Principal, after: str | None, limit: int
) -> tuple[list[Entry], bool]:
    """One page of the entries ``principal`` may read, after ``after``, and whether more follow. For
    the admin (and anonymous readers) one catalog page; a key walks pages until its own fill one."""
    if principal.sees_all:
        entries = registry.catalog.page(after, limit + 1)
        return entries[:limit], len(entries) > limit
    found: list[Entry] = []
    cursor = after
    while len(found) <= limit:
        entries = registry.catalog.page(cursor, 1000)
        found += [e for e in entries if principal.may_read(e.name)]
        if len(entries) < 1000:
            break
        cursor = entries[-1].name
    return found[:limit], len(found) > limit


@router.get(
    "",
    response_model=AdapterList,
    responses=errors(400, 401, 403, 422, 503),
    summary="Registered adapters (paged by name), and store objects not served; a key's own only",
)
def list_adapters(
    registry: RegistryDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="adapters per page")] = 100,
    after: Annotated[
        str | None, Query(max_length=64, description="the previous page's `next`: list names after it")
    ] = None,
) -> AdapterList:
    info, invalid = registry.info(), registry.invalid
    page, more = _visible_page(registry, principal, after, limit)  # no bundle is read
    last = page[-1].name if more else None
    return AdapterList(
        registry=_registry(info),
        max_tasks_per_request=registry.max_tasks,
        adapters=[_info(entry) for entry in page],
        invalid={
            n: why
            for n, why in sorted(invalid.items())
            if principal.may_read(n) and (after is None or n > after) and (last is None or n <= last)
        },
        next=last,
    )


@router.get("/{name}", response_model=AdapterInfo, responses=errors(400, 401, 403, 404, 422, 503))
def get_adapter(name: Name, registry: RegistryDep) -> AdapterInfo:
    return _info(registry.get(name), registry.training(name))


@router.post(
    "",
    response_model=AdapterCreated,
    status_code=201,
    responses=errors(400, 401, 403, 408, 409, 413, 415, 422, 503),
    summary="Register an adapter bundle (validated completely, persisted atomically, served at once)",
    dependencies=[Depends(require_multipart)],
)
async def register_adapter(
    registry: RegistryDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    audit: AuditDep,
    bundle: Annotated[UploadFile, File(description="a memvit.adapter/1 safetensors file")],
    replace: Annotated[bool, Query(description="swap out an adapter of the same name")] = False,
) -> AdapterCreated:
    limit = settings.max_bundle_bytes
    too_large = BundleTooLargeError(f"bundle over the {limit}-byte upload limit", field="bundle")
    data = await read_upload(bundle, limit, too_large)

    def authorize(parsed: AdapterBundle) -> None:
        """The bundle's name (and the parent it extends) against the caller's key, before anything else."""
        audit.name = parsed.name
        if not principal.may_write(parsed.name):
            raise name_refused(principal, parsed.name, "change")
        parent = parsed.weights.parent
        if parent is not None and not principal.may_read(parent):
            raise name_refused(principal, parent, "read")

    def register() -> tuple[Entry, RegistryInfo, bool]:
        audit.sha256 = hashlib.sha256(data).hexdigest()
        return registry.register(data, replace=replace, authorize=authorize)

    current, info, replaced = await asyncio.to_thread(register)
    return AdapterCreated(adapter=_info(current), registry=_registry(info), replaced=replaced)


@router.delete(
    "/{name}",
    response_model=AdapterDeleted,
    responses=errors(400, 401, 403, 404, 409, 422, 503),
)
async def delete_adapter(
    name: Name, registry: RegistryDep, principal: PrincipalDep, audit: AuditDep
) -> AdapterDeleted:
    with contextlib.suppress(UnknownAdapterError):  # not registered (or invalid): the registry says so below
        audit.sha256 = registry.get(name).sha256
    info = await asyncio.to_thread(registry.delete, name)
    return AdapterDeleted(deleted=name, registry=_registry(info))
