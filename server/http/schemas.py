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


class RegistryInfo(BaseModel):
    version: int = Field(
        description="the registry's version: the number of changes its journal holds. Only grows, and "
        "equal versions mean equal registries on every replica"
    )
    adapters: int = Field(description="adapters registered (resident in memory or not)")


class ClassifyResponse(BaseModel):
    registry: RegistryInfo = Field(description="the registry that answered")
    tasks: list[str] = Field(description="the tasks answered, base first when asked for")
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
    training: dict[str, Any] | None = Field(
        None, description="how it was trained; only GET /adapters/{name} reads it (null in lists)"
    )


class AdapterCreated(BaseModel):
    adapter: AdapterInfo = Field(
        description="the adapter registered under this name after the change: the upload, unless "
        "another replica replaced it in the same moment (compare `sha256`)"
    )
    registry: RegistryInfo
    replaced: bool


class AdapterList(BaseModel):
    registry: RegistryInfo
    max_tasks_per_request: int = Field(
        description="adapters one /classify may ask for; with no `tasks`, the most the registry may hold"
    )
    adapters: list[AdapterInfo] = Field(description="one page of registered adapters, by name")
    invalid: dict[str, str] = Field(description="store objects in this page's name range not served, and why")
    next: str | None = Field(None, description="pass as `after` for the next page; null on the last page")


class AdapterDeleted(BaseModel):
    deleted: str
    registry: RegistryInfo


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


class UsageEntry(BaseModel):
    day: str = Field(description="UTC day (YYYY-MM-DD) the usage was written in")
    key: str = Field(description="the key's id; `admin` and `anonymous` for the callers without a key")
    task: str = Field(description="`base`: every request of the key; an adapter: the requests asking for it")
    requests: int
    images: int = Field(description="images answered (`base`), or rows the adapter computed")


class UsageReport(BaseModel):
    since: str
    until: str
    written_every_seconds: float = Field(description="how often usage is written (the last is not in yet)")
    usage: list[UsageEntry]
