"""trl_async: asynchronous GRPO/PPO for Hugging Face TRL, with M2PO and tensor-native rewards.

The public names are imported on first use (PEP 562), so that the generation process, which imports only
`trl_async.rollout` and `trl_async.rewards`, starts without importing TRL's trainers (seconds of start-up per rank).
"""

import importlib

from . import _compat

__version__ = "0.1.0"
_compat.install()  # old import paths keep working, with a warning, until _compat.REMOVAL_VERSION

_PUBLIC = {
    "AsyncGRPOConfig": ".config",
    "AsyncGRPOTrainer": ".trainers.grpo",
    "AsyncPPOConfig": ".config",
    "AsyncPPOTrainer": ".trainers.ppo",
    "StalenessBoundedQueue": ".rollout",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_async' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
