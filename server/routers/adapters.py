"""The adapter resource: list, describe, register (validated, persisted, live), delete."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Query, UploadFile

from adapters import AdapterBundle
from memory_core import NAME_PATTERN, AdapterSet

from ..deps import AdaptersDep, EngineDep, SettingsDep, require_admin, require_multipart
from ..errors import BundleTooLargeError
from ..schemas import AdapterCreated, AdapterDeleted, AdapterInfo, AdapterList, AdapterSetInfo, ErrorResponse

router = APIRouter(prefix="/adapters", tags=["adapters"])
Name = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="adapter name")]


def _info(bundle: AdapterBundle) -> AdapterInfo:
    return AdapterInfo.model_validate(bundle.describe())  # extra keys (layers, width) are ignored


def _set_info(adapter_set: AdapterSet) -> AdapterSetInfo:
    return AdapterSetInfo(version=adapter_set.version, adapters=list(adapter_set.names))


@router.get("", response_model=AdapterList, summary="Live adapters, and store files that are not loaded")
def list_adapters(engine: EngineDep, registry: AdaptersDep) -> AdapterList:
    live = engine.adapters
    return AdapterList(
        adapter_set=_set_info(live),
        adapters=[_info(registry.bundle(name)) for name in live.names],
        invalid=dict(registry.invalid),
    )


@router.get("/{name}", response_model=AdapterInfo, responses={404: {"model": ErrorResponse}})
def get_adapter(name: Name, registry: AdaptersDep) -> AdapterInfo:
    return _info(registry.bundle(name))


@router.post(
    "",
    response_model=AdapterCreated,
    status_code=201,
    responses={code: {"model": ErrorResponse} for code in (401, 403, 409, 413, 422)},
    summary="Register an adapter bundle (validated completely, persisted atomically, live at once)",
    dependencies=[Depends(require_admin), Depends(require_multipart)],
)
async def register_adapter(
    engine: EngineDep,
    registry: AdaptersDep,
    settings: SettingsDep,
    bundle: Annotated[UploadFile, File(description="a memvit.adapter/1 safetensors file")],
    replace: Annotated[bool, Query(description="swap out an adapter of the same name")] = False,
) -> AdapterCreated:
    limit = settings.max_bundle_bytes
    data = await bundle.read(limit + 1)
    if len(data) > limit:
        raise BundleTooLargeError(f"bundle over the {limit}-byte upload limit", field="bundle")
    existed = engine.adapters
    created, live = await asyncio.to_thread(registry.register, data, replace=replace)
    return AdapterCreated(
        adapter=_info(created), adapter_set=_set_info(live), replaced=created.name in existed
    )


@router.delete(
    "/{name}",
    response_model=AdapterDeleted,
    responses={404: {"model": ErrorResponse}},
    dependencies=[Depends(require_admin)],
)
async def delete_adapter(name: Name, registry: AdaptersDep) -> AdapterDeleted:
    live = await asyncio.to_thread(registry.delete, name)
    return AdapterDeleted(deleted=name, adapter_set=_set_info(live))
