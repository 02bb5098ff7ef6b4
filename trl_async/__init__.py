"""trl_async: asynchronous GRPO/PPO for Hugging Face TRL, with M2PO and tensor-native rewards."""

from .config import AsyncGRPOConfig
from .grpo import AsyncGRPOTrainer
from .rollout import StalenessBoundedQueue

__version__ = "0.1.0"

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "StalenessBoundedQueue", "__version__"]
