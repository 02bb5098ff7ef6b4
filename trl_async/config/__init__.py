"""The trainers' configurations: `AsyncGRPOConfig` (TRL's `GRPOConfig` plus the asynchronous engine's and M2PO's
fields, `grpo`) and `AsyncPPOConfig` (PPO's, `ppo`). Dataclass fields with `help` metadata, validated in
`__post_init__` with messages that say what to do."""

from .grpo import (
    ASYNC_FIELDS,
    LOSS_TYPES,
    TRL_LOSS_TYPES,
    AsyncGRPOConfig,
    async_field,
    ensure_async_fields,
    validate_async_fields,
)
from .ppo import PPO_KL_ESTIMATORS, PPO_LOSS_TYPES, AsyncPPOConfig, validate_ppo_fields

__all__ = [
    "ASYNC_FIELDS",
    "LOSS_TYPES",
    "PPO_KL_ESTIMATORS",
    "PPO_LOSS_TYPES",
    "TRL_LOSS_TYPES",
    "AsyncGRPOConfig",
    "AsyncPPOConfig",
    "async_field",
    "ensure_async_fields",
    "validate_async_fields",
    "validate_ppo_fields",
]
