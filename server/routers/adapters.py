"""The adapter resource: list, describe, register (validated, persisted, live), delete."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Query, UploadFile

from adapters import AdapterBundle
from memory_core import NAME_PATTERN, AdapterSet

from ..deps import AdminDep, RuntimeDep, require_multipart
from ..errors import BundleTooLargeError
from ..schemas import AdapterCreated, AdapterDeleted, AdapterInfo, AdapterList, AdapterSetInfo, ErrorResponse

router = APIRouter(prefix="/adapters", tags=["adapters"])
Name = Annotated[str, Path(pattern=NAME_PATTERN.pattern, description="adapter name")]


def _info(bundle: AdapterBundle) -> AdapterInfo:
    return AdapterInfo.model_validate(bundle.describe())  # extra keys (layers, width) are ignored


def _set_info(adapter_set: AdapterSet) -> AdapterSetInfo:
    return AdapterSetInfo(version=adapter_set.version, adapters=list(adapter_set.names))


@router.get("", response_model=AdapterList, summary="Live adapters, and store files that are not loaded")
def list_adapters(runtime: RuntimeDep) -> AdapterList:
    service = runtime.adapters
    live = runtime.engine.adapters
    return AdapterList(
        adapter_set=_set_info(live),
        adapters=[_info(service.bundle(name)) for name in live.names],
        invalid=dict(service.invalid),
    )


@router.get("/{name}", response_model=AdapterInfo, responses={404: {"model": ErrorResponse}})
def get_adapter(name: Name, runtime: RuntimeDep) -> AdapterInfo:
    return _info(runtime.adapters.bundle(name))


@router.post(
    "",
    response_model=AdapterCreated,
    status_code=201,
    responses={code: {"model": ErrorResponse} for code in (401, 403, 409, 413, 422)},
    summary="Register an adapter bundle (validated completely, persisted atomically, live at once)",
)
async def register_adapter(
    runtime: AdminDep,
    _: Annotated[None, Depends(require_multipart)],
    bundle: Annotated[UploadFile, File(description="a memvit.adapter/1 safetensors file")],
    replace: Annotated[bool, Query(description="swap out an adapter of the same name")] = False,
) -> AdapterCreated:
    limit = runtime.settings.max_bundle_bytes
    data = await bundle.read(limit + 1)
    if len(data) > limit:
        raise BundleTooLargeError(f"bundle over the {limit}-byte upload limit", field="bundle")
    existed = runtime.engine.adapters
    created, live = await asyncio.to_thread(runtime.adapters.register, data, replace=replace)
    return AdapterCreated(
        adapter=_info(created), adapter_set=_set_info(live), replaced=created.name in existed
    )


@router.delete("/{name}", response_model=AdapterDeleted, responses={404: {"model": ErrorResponse}})
async def delete_adapter(name: Name, runtime: AdminDep) -> AdapterDeleted:
    live = await asyncio.to_thread(runtime.adapters.delete, name)
    return AdapterDeleted(deleted=name, adapter_set=_set_info(live))
