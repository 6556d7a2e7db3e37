"""The adapter resource: list (paged), describe, register (validated, persisted, live), delete.

Registering and deleting are admin routes: the guard (server/edge/) has checked the caller (a key's
names too, when the path holds one), and capped the body, before these handlers run; a bundle's name
is checked against the key once the registry has parsed it. Every answer names only the adapters the
caller may read, and each change fills in the audit entry the guard opened (server/audit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Query, UploadFile

from adapters import AdapterBundle
from memory_core import NAME_PATTERN, AdapterSet, UnknownAdapterError

from ..deps import AuditDep, PrincipalDep, RegistryDep, SettingsDep, require_multipart
from ..edge.access import name_refused
from ..edge.body import read_upload
from ..edge.principal import Principal
from ..errors import BundleTooLargeError
from ..openapi import errors
from ..registry import StoredAdapter
from ..schemas import AdapterCreated, AdapterDeleted, AdapterInfo, AdapterList, AdapterSetInfo

router = APIRouter(prefix="/adapters", tags=["adapters"])
Name = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="adapter name")]


def _info(stored: StoredAdapter) -> AdapterInfo:
    # extra keys of describe() (layers, width) are ignored
    return AdapterInfo.model_validate({**stored.bundle.describe(), "sha256": stored.sha256})


def _set_info(adapter_set: AdapterSet, principal: Principal) -> AdapterSetInfo:
    return AdapterSetInfo(version=adapter_set.version, adapters=principal.visible(adapter_set.names))


@router.get(
    "",
    response_model=AdapterList,
    responses=errors(400, 401, 403, 422, 503),
    summary="Live adapters (paged by name), and store objects not loaded; a key's own only",
)
def list_adapters(
    registry: RegistryDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="adapters per page")] = 100,
    after: Annotated[
        str | None, Query(max_length=64, description="the previous page's `next`: list names after it")
    ] = None,
) -> AdapterList:
    live, invalid = registry.live.current, dict(registry.invalid)
    names = sorted(n for n in principal.visible(live.names) if after is None or n > after)
    page, more = names[:limit], len(names) > limit
    last = page[-1] if more else None
    return AdapterList(
        adapter_set=_set_info(live, principal),
        adapters=[_info(registry.get(name)) for name in page],
        invalid={
            n: why
            for n, why in sorted(invalid.items())
            if principal.may_read(n) and (after is None or n > after) and (last is None or n <= last)
        },
        next=last,
    )


@router.get("/{name}", response_model=AdapterInfo, responses=errors(400, 401, 403, 404, 422, 503))
def get_adapter(name: Name, registry: RegistryDep) -> AdapterInfo:
    return _info(registry.get(name))


@router.post(
    "",
    response_model=AdapterCreated,
    status_code=201,
    responses=errors(400, 401, 403, 408, 409, 413, 415, 422, 503),
    summary="Register an adapter bundle (validated completely, persisted atomically, live at once)",
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
    existed = registry.live.current

    def authorize(parsed: AdapterBundle) -> None:
        """The bundle's name (and the parent it extends) against the caller's key, before anything else."""
        audit.name = parsed.name
        if not principal.may_write(parsed.name):
            raise name_refused(principal, parsed.name, "change")
        parent = parsed.weights.parent
        if parent is not None and not principal.may_read(parent):
            raise name_refused(principal, parent, "read")

    def register() -> tuple[StoredAdapter, AdapterSet]:
        audit.sha256 = hashlib.sha256(data).hexdigest()
        return registry.register(data, replace=replace, authorize=authorize)

    current, live = await asyncio.to_thread(register)
    return AdapterCreated(
        adapter=_info(current),
        adapter_set=_set_info(live, principal),
        replaced=current.bundle.name in existed,
    )


@router.delete(
    "/{name}",
    response_model=AdapterDeleted,
    responses=errors(400, 401, 403, 404, 409, 422, 503),
)
async def delete_adapter(
    name: Name, registry: RegistryDep, principal: PrincipalDep, audit: AuditDep
) -> AdapterDeleted:
    with contextlib.suppress(UnknownAdapterError):  # not live (or invalid): the registry says which below
        audit.sha256 = registry.get(name).sha256
    live = await asyncio.to_thread(registry.delete, name)
    return AdapterDeleted(deleted=name, adapter_set=_set_info(live, principal))
