"""memvit's engine: a frozen timm ViT plus learnable-memory adapters in one fused forward pass.

Sandler et al., "Fine-tuning Image Transformers using Learnable Memory" (CVPR 2022). No web or
file-format code lives here: bundles are ``adapters/``, HTTP is ``server/``.
"""

from .engine.live import LiveAdapters
from .engine.model import MemoryViT
from .errors import (
    AdapterError,
    AdapterInUseError,
    AdapterShapeError,
    DuplicateAdapterError,
    InputError,
    InvalidAdapterError,
    MemvitError,
    MissingParentError,
    UnknownAdapterError,
    UnsupportedModelError,
    WeightsError,
)
from .output.fused import FusedOutput
from .output.index import Answers, OutputIndex
from .routing.plan import PassPlan, PlanShape
from .routing.planner import plan_pass
from .routing.slot_table import SlotTable
from .routing.slots import AdapterSlots, SlotPools
from .sets.adapter_set import AdapterSet
from .sets.stack import AdapterStack, PreparedAdapter
from .sets.task_index import TaskIndex
from .weights.adapter import (
    BASE_TASK,
    MEMORY_NORMS,
    NAME_PATTERN,
    AdapterWeights,
    check_memory_norm,
    check_name,
)
from .weights.base_model import BaseModel, create_base, read_weights_metadata, save_base
from .weights.fingerprint import state_fingerprint
from .weights.flops import AdapterCost, adapter_flops, base_flops, flop_ratio, fused_flops, uniform_adapters
from .weights.spec import ViTSpec, check_supported

__all__ = [
    "BASE_TASK",
    "MEMORY_NORMS",
    "NAME_PATTERN",
    "AdapterCost",
    "AdapterError",
    "AdapterInUseError",
    "AdapterSet",
    "AdapterShapeError",
    "AdapterSlots",
    "AdapterStack",
    "AdapterWeights",
    "Answers",
    "BaseModel",
    "DuplicateAdapterError",
    "FusedOutput",
    "InputError",
    "InvalidAdapterError",
    "LiveAdapters",
    "MemoryViT",
    "MemvitError",
    "MissingParentError",
    "OutputIndex",
    "PassPlan",
    "PlanShape",
    "PreparedAdapter",
    "SlotPools",
    "SlotTable",
    "TaskIndex",
    "UnknownAdapterError",
    "UnsupportedModelError",
    "ViTSpec",
    "WeightsError",
    "adapter_flops",
    "base_flops",
    "check_memory_norm",
    "check_name",
    "check_supported",
    "create_base",
    "flop_ratio",
    "fused_flops",
    "plan_pass",
    "read_weights_metadata",
    "save_base",
    "state_fingerprint",
    "uniform_adapters",
]
