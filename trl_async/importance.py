"""Moved to `trl_async.algorithms.importance`; this module keeps old imports working."""

import warnings

from .algorithms.importance import *  # noqa: F403

warnings.warn(
    "trl_async.importance moved to trl_async.algorithms.importance; import it from there.",
    FutureWarning,
    stacklevel=2,
)
