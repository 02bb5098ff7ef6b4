"""Moved to `trl_async.trainers.ppo` and `trl_async.trainers.critic` (import `AsyncPPOTrainer` from `trl_async`);
kept for old imports."""

import warnings

from .algorithms.ppo import PPOTargets, ppo_targets
from .trainers.critic import CRITIC_ADAPTER, CRITIC_FILE, AdapterValueModel, PerTokenValueModel
from .trainers.ppo import AsyncPPOTrainer

warnings.warn(
    "trl_async.ppo moved to trl_async.trainers.ppo; import AsyncPPOTrainer from trl_async.",
    FutureWarning,
    stacklevel=2,
)

__all__ = [
    "CRITIC_ADAPTER",
    "CRITIC_FILE",
    "AdapterValueModel",
    "AsyncPPOTrainer",
    "PPOTargets",
    "PerTokenValueModel",
    "ppo_targets",
]
