"""Moved to `trl_async.trainers.grpo` (import `AsyncGRPOTrainer` from `trl_async`); kept for old imports."""

import warnings

from .trainers.grpo import AsyncGRPOTrainer

warnings.warn(
    "trl_async.grpo moved to trl_async.trainers.grpo; import AsyncGRPOTrainer from trl_async.",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["AsyncGRPOTrainer"]
