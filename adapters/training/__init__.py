"""Making adapters: fine-tune on an image folder (``run.TrainingRun``; ``trainer`` in one call), measure
accuracy (``metrics``).

May import: ``memvit.memory_core``, ``adapters.files``, ``adapters.preprocess``, ``adapters.bundle``.
"""

from .config import TrainConfig, TrainingError
from .data import DataError, Samples, scan_folder, split
from .metrics import Accuracy, TaskReport, evaluate_many, evaluate_tasks
from .results import TrainResult
from .run import TrainingRun
from .trainable import TrainableAdapter
from .trainer import train_adapter, train_adapters

__all__ = [
    "Accuracy",
    "DataError",
    "Samples",
    "TaskReport",
    "TrainConfig",
    "TrainResult",
    "TrainableAdapter",
    "TrainingError",
    "TrainingRun",
    "evaluate_many",
    "evaluate_tasks",
    "scan_folder",
    "split",
    "train_adapter",
    "train_adapters",
]
