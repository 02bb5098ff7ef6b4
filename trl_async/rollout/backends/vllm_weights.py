"""How policy weights reach vLLM, for both vLLM backends: PEFT names mapped to checkpoint names, LoRA adapters written
as PEFT folders (or merged into the base for transports without an adapter path), vLLM's own LoRA checks, staging
copies of the shared-memory stores, and the repacking of tied layers after an in-place reload.

The engine (`vllm.VLLMBackend`) and the server (`vllm_server.VLLMServerBackend`, and the `ServerWorkerExtension` it
runs in the server's workers) move weights the same way, so the rules live here, once. vLLM is imported only inside
the functions that need it.
"""

from __future__ import annotations

import json
import os

import torch

from ..weights import SharedWeightStore

# vLLM allocates LoRA buffers for one of these ranks (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def base_weight_name(name: str) -> str:
    """Checkpoint name of a PEFT model's base parameter (as in TRL's `_iter_named_params`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def adapter_checkpoint_name(name: str, adapter_name: str) -> str:
    """PEFT's on-disk name of an adapter tensor: the adapter name is dropped (`lora_A.default.weight` → `lora_A.weight`),
    as `peft.get_peft_model_state_dict` does."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{adapter_name}."
        if marker in name:
            return name.replace(marker, f".{part}.")
    raise ValueError(
        f"The trainable tensor {name!r} is not a LoRA A/B matrix of adapter {adapter_name!r}. vLLM serves plain LoRA "
        "adapters only (no modules_to_save, DoRA magnitudes, embedding LoRA or trainable biases)."
    )


def lora_rank_slot(peft_config) -> int:
    """Smallest LoRA rank vLLM allocates buffers for that holds every rank of the adapter."""
    rank = max([int(peft_config.r), *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values())])
    for slot in _VLLM_LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank {_VLLM_LORA_RANKS[-1]}.")


def merge_lora_weights(
    frozen: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], peft_config, adapter_name: str
) -> dict[str, torch.Tensor]:
    """Base checkpoint with the adapter folded in, W + s·B·A, for transports that have no adapter path (NCCL).

    The per-module rank and scale s come from vLLM's own `PEFTHelper` (alpha/r, rsLoRA alpha/sqrt(r), rank and alpha
    patterns), so the merged weights are what vLLM would compute with the adapter loaded.
    """
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(json.loads(json.dumps(peft_config.to_dict(), default=list)))
    merged = {base_weight_name(name): t.clone() for name, t in frozen.items()}
    marker = f".lora_A.{adapter_name}."
    for name, lora_a in adapter.items():
        if marker not in name:
            adapter_checkpoint_name(name, adapter_name)  # raises for anything but LoRA A/B
            continue
        lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
        module = name.split(marker)[0]
        _, scale = helper.get_rank_and_scaling(module.removeprefix("base_model.model."))
        key = base_weight_name(module) + ".weight"
        merged[key] = merged[key] + (scale * (lora_b.float() @ lora_a.float())).to(merged[key].dtype)
    return merged


def refresh_tied_weight_kernels(model: torch.nn.Module) -> int:
    """Re-run the kernel-format processing of layers that share their weight with another layer; return their count.

    vLLM's in-place reload processes a layer when its checkpoint tensors arrive. A tied `lm_head` has none (the
    checkpoint loader skips it), so on the CPU backend, which keeps a prepacked copy of every GEMM weight, it would
    go on computing logits with the start-up embedding. Processing the tied layers again repacks the new weight; on
    GPU their processing is a no-op.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def staging_buffers(store: SharedWeightStore) -> dict[str, torch.Tensor]:
    """The backend's own copies of a store's tensors (empty until read): `read_into` copies one consistent version into
    them, and vLLM gets these, never the shared buffers the trainer overwrites whenever it publishes."""
    return {name: torch.empty_like(buffer) for name, buffer in store.buffers.items()}


def write_adapter(directory: str, peft_config, tensors: dict[str, torch.Tensor], adapter_name: str) -> None:
    """The adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), which vLLM loads as is."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    peft_config.save_pretrained(directory)
    state = {adapter_checkpoint_name(name, adapter_name): t.contiguous() for name, t in tensors.items()}
    save_file(state, os.path.join(directory, "adapter_model.safetensors"))


def validate_lora_for_vllm(peft_config) -> None:
    """vLLM's own adapter checks (DoRA, modules_to_save, biases, ...), run before the engine is built."""
    from vllm.lora.peft_helper import PEFTHelper

    errors = PEFTHelper.from_dict(json.loads(json.dumps(peft_config.to_dict(), default=list)))._validate_features()
    if errors:
        raise ValueError("vLLM cannot serve this LoRA configuration: " + " ".join(errors))
