"""Moved to `trl_async.algorithms.ppo`; this module keeps old imports working."""

import warnings

from .algorithms.ppo import *  # noqa: F403

warnings.warn(
    "trl_async.ppo_math moved to trl_async.algorithms.ppo; import it from there.",
    FutureWarning,
    stacklevel=2,
)
