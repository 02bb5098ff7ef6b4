"""Generation backends of the rollout process (`base`: the interface; `hf`: transformers; `vllm`: vLLM, optional).

`make_backend(name, ...)` builds one by name; the vLLM module is imported only when asked for (vLLM is an optional
dependency).
"""

from __future__ import annotations

from .base import GenerationBackend, GenerationOutput, ModelSpec, first_eos_mask
from .hf import HFBackend, generate_with_behaviour_logprobs, generation_config_for_rollouts

BACKENDS: dict[str, type[GenerationBackend]] = {"hf": HFBackend}


def make_backend(name: str, **kwargs) -> GenerationBackend:
    if name in ("vllm", "vllm-server") and name not in BACKENDS:
        from .vllm import VLLMBackend, VLLMServerBackend  # lazily: vLLM is an optional dependency

        BACKENDS.update({"vllm": VLLMBackend, "vllm-server": VLLMServerBackend})
    if name not in BACKENDS:
        raise ValueError(f"Unknown generation backend {name!r}; use one of {sorted(BACKENDS)}.")
    return BACKENDS[name](**kwargs)


__all__ = [
    "BACKENDS",
    "GenerationBackend",
    "GenerationOutput",
    "HFBackend",
    "ModelSpec",
    "first_eos_mask",
    "generate_with_behaviour_logprobs",
    "generation_config_for_rollouts",
    "make_backend",
]
