"""memvit's engine: a frozen timm ViT plus learnable-memory adapters in one fused forward pass.

Sandler et al., "Fine-tuning Image Transformers using Learnable Memory" (CVPR 2022). No web or
file-format code lives here: bundles are ``adapters/``, HTTP is ``server/``.

Rooms, lowest first: a module may import its own room and those listed before it, never one after
(tests/test_import_graph.py checks it):

    errors, runtime  domain errors; process settings (malloc, float32 exactness). Import nothing here.
    weights, block   what is loaded (spec, base and adapter weights, fingerprint, FLOPs); one
                     transformer block, base rows and class-token rows (the torch attention).
    sets             prepared adapters, their stack, the immutable AdapterSet, a batch's TaskIndex.
    output           what a pass returns: FusedOutput, OutputIndex, Answers.
    routing          the pass over slots: slot pools, plans, the planned pass, Triton kernels, graphs.
    invariant,       the batch-invariant mode (fixed call sizes);
      stored         the class-token path from stored activations (training, evaluation from a cache).
    engine           MemoryViT, adapter preparation, the live set: picks a pass and runs it.
    oracle           the dense-mask reference: tests and benchmarks import it, nothing here does.

The class token's attention, one function per purpose:

    purpose                        function                                     where it runs
    serving, torch path            block.attention.class_token_attention        CPU, or kernels="torch";
                                   (training from images: the same, split)      every stack pass
    serving, kernel                routing.triton_kernels.                      CUDA (CPU tests: Triton's
                                     class_token_attention_kernel               interpreter)
    batch-invariant mode           invariant.attention.                         batch_invariant=True,
                                     invariant_class_token_attention            torch kernels
    training from stored fp16/     stored.cached_block.stored_class_token_block a CachedBatch: training
      bf16 activations             (written-out block, or the torch attention   and evaluation from an
                                   over stored_attention's readers)             activation cache
    oracle (dense mask)            oracle.reference.DenseMemoryViT              tests, benchmarks only
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
