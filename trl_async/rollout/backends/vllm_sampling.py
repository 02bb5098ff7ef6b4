"""What both vLLM backends sample with: TRL's generation settings as `vllm.SamplingParams` fields, per-row seeds, and
vLLM's variable-length completions packed into the `GenerationOutput` layout.

The engine (`vllm.VLLMBackend`) and the server (`vllm_server.VLLMServerBackend`) sample from the same processed
distribution and must refuse the same settings, so they translate them here, once. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from .base import GenerationOutput

# GenerationConfig fields that `sampling_kwargs` maps onto SamplingParams.
_MAPPED_FIELDS = {
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_return_sequences",
}
# GenerationConfig fields that do not change what is sampled (caching, compilation, output format, special ids:
# the EOS ids come in through `eos_token_ids`, padding is ours).
_INERT_FIELDS = {
    "use_cache",
    "cache_implementation",
    "cache_config",
    "max_cache_len",
    "disable_compile",
    "compile_config",
    "output_logits",
    "output_scores",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "low_memory",
    "transformers_version",
    "_from_model_config",
}
# SamplingParams fields the backend owns: overriding them would break the contract (one completion per row, token ids
# in and out, the sampled token's processed log-prob, stopping at EOS).
_OWNED_SAMPLING_FIELDS = {"n", "logprobs", "seed", "detokenize", "stop_token_ids", "ignore_eos", "output_kind"}


def sampling_kwargs(
    generation_config: GenerationConfig,
    temperature: float,
    eos_token_ids: list[int],
    overrides: dict | None = None,
) -> dict:
    """Translate TRL's `GenerationConfig` into `vllm.SamplingParams` keyword arguments, one completion per prompt.

    Raises `ValueError` naming every setting vLLM cannot honour, rather than sampling from a different distribution
    than the one the trainer configured. `overrides` are extra SamplingParams fields (TRL's `generation_kwargs` under
    `use_vllm=True` are vLLM's names); the ones the backend owns are refused.
    """
    diff = generation_config.to_diff_dict()
    unsupported = sorted(set(diff) - _MAPPED_FIELDS - _INERT_FIELDS)
    if "max_length" in unsupported and generation_config.max_new_tokens is not None:
        unsupported.remove("max_length")  # `max_new_tokens` takes precedence in transformers too
    if unsupported:
        raise ValueError(
            "The vllm generation backend cannot honour these generation settings: "
            + ", ".join(f"{name}={diff[name]!r}" for name in unsupported)
            + ". Remove them from `generation_kwargs` (vLLM's own sampling options can be passed as vLLM "
            "SamplingParams fields instead), or use generation_backend='hf'."
        )
    if generation_config.max_new_tokens is None:
        raise ValueError("The vllm generation backend needs `max_new_tokens` (TRL's `max_completion_length`).")
    if generation_config.do_sample is False:
        raise ValueError(
            "The vllm generation backend samples (do_sample=True); greedy decoding has no behaviour distribution "
            "to correct against. Set do_sample=True."
        )
    if (generation_config.num_return_sequences or 1) != 1:
        raise ValueError(
            "The vllm generation backend returns one completion per prompt row; set num_return_sequences=1."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}.")
    config_temperature = diff.get("temperature")
    if config_temperature is not None and abs(config_temperature - temperature) > 1e-12:
        raise ValueError(
            f"generation_config.temperature={config_temperature} differs from the trainer's temperature="
            f"{temperature}; the behaviour log-probs would not match the trainer's scaling. Use one value."
        )
    kwargs = {
        "n": 1,
        "max_tokens": int(generation_config.max_new_tokens),
        "min_tokens": int(generation_config.min_new_tokens or 0),
        "temperature": float(temperature),
        "top_p": 1.0 if generation_config.top_p is None else float(generation_config.top_p),
        "top_k": 0 if generation_config.top_k is None else int(generation_config.top_k),
        "min_p": 0.0 if generation_config.min_p is None else float(generation_config.min_p),
        "repetition_penalty": (
            1.0 if generation_config.repetition_penalty is None else float(generation_config.repetition_penalty)
        ),
        "stop_token_ids": list(eos_token_ids),
        "ignore_eos": False,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }
    overrides = dict(overrides or {})
    owned = sorted(set(overrides) & _OWNED_SAMPLING_FIELDS)
    if owned:
        raise ValueError(
            f"These SamplingParams fields are set by the vllm generation backend and cannot be overridden: {owned}."
        )
    kwargs.update(overrides)
    return kwargs


def row_seeds(seed: int | None, num_rows: int) -> list[int | None]:
    """Distinct, reproducible per-request seeds derived from one batch seed (None: unseeded)."""
    if seed is None:
        return [None] * num_rows
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2**62, (num_rows,), generator=generator).tolist()


def pack_completions(
    token_ids: list[list[int]], logprobs: list[list[float]], eos_token_ids: list[int], pad_token_id: int
) -> GenerationOutput:
    """Right-pad variable-length completions into the `GenerationOutput` layout (cut after the first EOS)."""
    eos = set(eos_token_ids)
    lengths = []
    for ids in token_ids:
        first_eos = next((i for i, t in enumerate(ids) if t in eos), None)
        lengths.append(len(ids) if first_eos is None else first_eos + 1)
    width = max([1, *lengths])
    ids_out = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    logps_out = torch.zeros((len(token_ids), width), dtype=torch.float32)
    mask = torch.zeros((len(token_ids), width), dtype=torch.bool)
    for row, (ids, logps, n) in enumerate(zip(token_ids, logprobs, lengths, strict=True)):
        ids_out[row, :n] = torch.tensor(ids[:n], dtype=torch.long)
        logps_out[row, :n] = torch.tensor(logps[:n], dtype=torch.float32)
        mask[row, :n] = True
    return GenerationOutput(completion_ids=ids_out, completion_mask=mask, logprobs=logps_out)
