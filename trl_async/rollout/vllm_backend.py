"""Moved to `trl_async.rollout.backends.vllm`; this module keeps old imports and `python -m` commands working."""

import warnings

from .backends.vllm import *  # noqa: F403
from .backends.vllm import _serve_main

warnings.warn(
    "trl_async.rollout.vllm_backend moved to trl_async.rollout.backends.vllm; import it from there.",
    FutureWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    _serve_main()
