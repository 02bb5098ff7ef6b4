"""Moved to `trl_async.rollout.backends.vllm` (the engine), `.vllm_server` (the server and its launcher),
`.vllm_sampling` and `.vllm_weights` (what both share); this module keeps old imports and `python -m` commands
working."""

import warnings

from .backends.base import ModelSpec  # noqa: F401 (the old module re-exported it: old code builds backends with it)
from .backends.vllm import *  # noqa: F403
from .backends.vllm_sampling import *  # noqa: F403
from .backends.vllm_server import *  # noqa: F403
from .backends.vllm_server import _serve_main
from .backends.vllm_weights import *  # noqa: F403

warnings.warn(
    "trl_async.rollout.vllm_backend moved to trl_async.rollout.backends.vllm and .vllm_server; import it from there.",
    FutureWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    _serve_main()
