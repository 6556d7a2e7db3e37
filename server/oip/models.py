"""How memvit looks to an Open Inference Protocol client: its models, their inputs and outputs.

- Model ``base`` is the fused model: one output per task (``base``, and one per adapter, named after
  it), and the outputs a request asks for route the pass as ``?tasks=`` does; no outputs asked for
  means every task, as an unfiltered ``/classify``.
- Every adapter is also a model of its own name, with one output, ``logits``: the shape a Triton
  user expects of a fine-tune, served by the same fused pass and batcher.

Both take one of two inputs: ``IMAGE`` (BYTES, one encoded image per element, decoded by the same
safe decoder as ``/classify``) or ``PIXELS`` (FP32, images already preprocessed as the base expects).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memvit.memory_core import BASE_TASK, MemoryViT

from ..edge.principal import Principal
from ..errors import ServiceError

if TYPE_CHECKING:
    from ..registry import AdapterRegistry

PLATFORM = "memvit"
IMAGE, PIXELS, LOGITS = "IMAGE", "PIXELS", "LOGITS"
ADAPTER_OUTPUT = "logits"


class ModelNotFoundError(ServiceError):
    status = 404


def known_models(registry: AdapterRegistry, principal: Principal) -> list[str]:
    """The models a caller may see: the base (fused) model, then each registered adapter it may read."""
    return [BASE_TASK, *principal.visible(registry.all_names())]


def tasks_of(model: str, registry: AdapterRegistry, principal: Principal) -> list[str] | None:
    """The tasks behind ``model`` before any output is asked for (None: every task of the base model).
    A model the caller may not read, or that does not exist, is 404 alike: a tenant is never told
    whether another tenant's adapter exists."""
    if model == BASE_TASK:
        return None
    if not principal.may_read(model) or registry.unknown([model]):
        raise ModelNotFoundError(f"no model named {model!r} (GET /v2/repository/index lists them)")
    return [model]


def metadata(
    model: str, engine: MemoryViT, registry: AdapterRegistry, principal: Principal
) -> dict[str, Any]:
    """The model's metadata: name, versions, platform, inputs and outputs with datatypes and shapes."""
    tasks = tasks_of(model, registry, principal)
    in_chans = engine.base.patch_embed.proj.in_channels
    inputs = [
        {"name": IMAGE, "datatype": "BYTES", "shape": [-1]},
        {"name": PIXELS, "datatype": "FP32", "shape": [-1, in_chans, *engine.spec.img_size]},
    ]
    if tasks is None:
        names = known_models(registry, principal)
        outputs = [
            {"name": t, "datatype": "FP32", "shape": [-1, _classes(t, engine, registry)]} for t in names
        ]
    else:
        outputs = [
            {"name": ADAPTER_OUTPUT, "datatype": "FP32", "shape": [-1, _classes(model, engine, registry)]}
        ]
    return {
        "name": model,
        "versions": ["1"],
        "platform": PLATFORM,
        "inputs": inputs,
        "outputs": outputs,
    }


def _classes(task: str, engine: MemoryViT, registry: AdapterRegistry) -> int:
    """From the registry's entry: metadata reads no bundle and makes nothing resident."""
    return int(engine.base.num_classes) if task == BASE_TASK else int(registry.get(task).num_classes)


def labels_of(task: str, engine: MemoryViT, registry: AdapterRegistry) -> tuple[str, ...] | None:
    return engine.labels if task == BASE_TASK else tuple(registry.get(task).labels)
