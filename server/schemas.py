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
    version: int = Field(description="identifies the adapter snapshot that answered")
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
    training: dict[str, Any] | None = None


class AdapterCreated(BaseModel):
    adapter: AdapterInfo
    adapter_set: AdapterSetInfo
    replaced: bool


class AdapterList(BaseModel):
    adapter_set: AdapterSetInfo
    adapters: list[AdapterInfo]
    invalid: dict[str, str] = Field(description="store files that are not loaded, and why")


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
