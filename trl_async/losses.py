"""Moved to `trl_async.algorithms.m2po`; this module keeps old imports working."""

import warnings

from .algorithms.m2po import *  # noqa: F403

warnings.warn(
    "trl_async.losses moved to trl_async.algorithms.m2po; import it from there.",
    FutureWarning,
    stacklevel=2,
)
