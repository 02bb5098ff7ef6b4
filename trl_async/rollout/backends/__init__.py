"""Generation backends of the rollout process.

`base`: the interface and `BackendContext`, what every backend is built from; `hf`: transformers `generate`; `vllm`:
a vLLM engine in the generation process; `vllm_server`: a running `trl vllm-serve` server (with `vllm_sampling` and
`vllm_weights`, what the two vLLM backends share; vLLM is optional).

`make_backend(name, context, **options)` builds one by name; the vLLM modules are imported only when asked for.
"""

from __future__ import annotations

from .base import BackendContext, GenerationBackend, GenerationOutput, ModelSpec, SeededPrompts, first_eos_mask
from .hf import HFBackend, generate_with_behaviour_logprobs, generation_config_for_rollouts

BACKENDS: dict[str, type[GenerationBackend]] = {"hf": HFBackend}


def make_backend(name: str, context: BackendContext, **options) -> GenerationBackend:
    """The backend called `name`, built from `context` and its own `options`."""
    if name in ("vllm", "vllm-server") and name not in BACKENDS:
        from .vllm import VLLMBackend  # lazily: vLLM is an optional dependency
        from .vllm_server import VLLMServerBackend

        BACKENDS.update({"vllm": VLLMBackend, "vllm-server": VLLMServerBackend})
    if name not in BACKENDS:
        raise ValueError(f"Unknown generation backend {name!r}; use one of {sorted(BACKENDS)}.")
    return BACKENDS[name](context, **options)


__all__ = [
    "BACKENDS",
    "BackendContext",
    "GenerationBackend",
    "GenerationOutput",
    "HFBackend",
    "ModelSpec",
    "SeededPrompts",
    "first_eos_mask",
    "generate_with_behaviour_logprobs",
    "generation_config_for_rollouts",
    "make_backend",
]
