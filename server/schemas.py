"""Request and response models: what /docs shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Prediction(BaseModel):
    label: str
    index: int = Field(description="row of the task's head")
    probability: float


class TaskResult(BaseModel):
    predictions: list[Prediction] = Field(description="the top-k labels, most probable first")
    logits: list[float] | None = Field(None, description="raw logits, when asked for")


class ImageResult(BaseModel):
    image: str = Field(description="the uploaded file's name (or its position)")
    tasks: dict[str, TaskResult]


class AdapterSetInfo(BaseModel):
    version: int = Field(
        description="the store generation the snapshot that answered was read at: only grows, and is "
        "equal across replicas serving the same adapters"
    )
    adapters: list[str]


class ClassifyResponse(BaseModel):
    adapter_set: AdapterSetInfo
    results: list[ImageResult]


class AdapterInfo(BaseModel):
    name: str
    parent: str | None
    memory_tokens: int
    memory_norm: str
    num_classes: int
    labels: list[str]
    base_model: str
    base_fingerprint: str
    sha256: str = Field(description="hash of the bundle's bytes as stored: equal across replicas serving it")
    training: dict[str, Any] | None = None


class AdapterCreated(BaseModel):
    adapter: AdapterInfo = Field(
        description="the adapter live under this name after the change: the upload, unless another "
        "replica replaced it in the same moment (compare `sha256`)"
    )
    adapter_set: AdapterSetInfo
    replaced: bool


class AdapterList(BaseModel):
    adapter_set: AdapterSetInfo
    adapters: list[AdapterInfo] = Field(description="one page of live adapters, by name")
    invalid: dict[str, str] = Field(description="store objects in this page's name range not loaded, and why")
    next: str | None = Field(None, description="pass as `after` for the next page; null on the last page")


class AdapterDeleted(BaseModel):
    deleted: str
    adapter_set: AdapterSetInfo


class Health(BaseModel):
    status: str
    detail: str | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ProtocolErrorResponse(BaseModel):
    """The Open Inference Protocol's error body, for every refusal under /v2."""

    error: str
