"""Making adapters: fine-tune on an image folder (``trainer``), measure accuracy (``metrics``)."""

from .data import DataError, Samples, scan_folder, split
from .metrics import Accuracy, TaskReport, evaluate_set, evaluate_tasks
from .trainable import TrainableAdapter
from .trainer import TrainConfig, TrainingError, TrainResult, train_adapter

__all__ = [
    "Accuracy",
    "DataError",
    "Samples",
    "TaskReport",
    "TrainConfig",
    "TrainResult",
    "TrainableAdapter",
    "TrainingError",
    "evaluate_set",
    "evaluate_tasks",
    "scan_folder",
    "split",
    "train_adapter",
]
