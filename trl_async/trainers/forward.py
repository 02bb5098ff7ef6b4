"""The trainers' training forward with each prompt computed once per group (`shared_prompt`), where it applies.

GRPO repeats every prompt `num_generations` times, and TRL's forward computes it for every row. Here, short
completions: the rows of a group are packed into one sequence, each completion attending to the shared prompt and to
itself. Long ones, where packing saves under 20% of the tokens: the prompts run once as a key/value prefix that the
completions attend to (a model not wrapped for distributed training only, which must see one forward per backward).
Same log-probs and gradients as TRL's forward (`tests/test_shared_prompt.py`); the model is called as TRL calls it
(fused LM head, labels, autocast).
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from ..config import async_field
from ..shared_prompt import pack_prompt_groups, prefix_forward, prefix_survives_checkpointing, split_prompt_prefix


def shared_prompt_logps(
    trainer, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
    multimodal_inputs: dict, trl_forward,
):  # fmt: skip
    """TRL's `(logps, entropies, aux_loss)` computed with shared prompts, or None where TRL's forward must run:
    `shared_prompt_forward` off (or "auto" off the CPU), multimodal inputs, an MoE load-balancing loss, or an attention
    kernel that takes no dense mask. Each of TRL's `batch_size` chunks is packed on its own; a chunk where neither
    packing nor the prefix saves enough runs TRL's forward, `trl_forward(input_ids, attention_mask)`."""
    packing = _packing_settings(trainer, model)
    if packing is None or compute_aux_loss or any(v is not None for v in multimodal_inputs.values()):
        return None
    attn_implementation, dtype = packing
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        packed = pack_prompt_groups(ids, mask, logits_to_keep)
        if packed is not None:
            with trainer.accelerator.autocast():
                outputs = model(
                    input_ids=packed.input_ids,
                    attention_mask=packed.attention_mask(attn_implementation, dtype),
                    position_ids=packed.position_ids,
                    labels=packed.labels,
                    fused_lm_head=True,
                )
            logps = packed.unpack(outputs.log_probs)
            entropies = packed.unpack(outputs.entropy) if compute_entropy else None
        elif (
            outputs := _prefix_forward(trainer, model, ids, mask, logits_to_keep, attn_implementation, dtype)
        ) is not None:
            logps, entropies = outputs.log_probs, outputs.entropy if compute_entropy else None
        else:
            logps, entropies, _ = trl_forward(ids, mask)
        all_logps.append(logps)
        all_entropies.append(entropies)
    return torch.cat(all_logps), torch.cat(all_entropies) if compute_entropy else None, None


def _packing_settings(trainer, model) -> tuple[str, torch.dtype] | None:
    """(attention implementation, dtype) when the packed forward applies to `model`, else None."""
    mode = async_field(trainer.args, "shared_prompt_forward")
    if mode == "off" or (mode == "auto" and trainer.accelerator.device.type != "cpu"):
        return None
    config = getattr(trainer._unwrap(model), "config", None)
    attn_implementation = getattr(config, "_attn_implementation", None)
    if attn_implementation not in ("sdpa", "eager") or config.get_text_config() is not config:
        return None  # flash / flex kernels take no dense mask; a vision-language model's inputs are not all text
    return attn_implementation, next(model.parameters()).dtype


def _prefix_forward(trainer, model, input_ids, attention_mask, logits_to_keep, attn_implementation, dtype):
    """TRL's fused-head outputs for the rows with each prompt run once as a key/value prefix
    (`shared_prompt.prefix_forward`), or None where that does not apply: too small a saving, a model wrapped for
    distributed training (DDP, FSDP, DeepSpeed reduce gradients per forward call, and this is two calls), a model
    with other than full-attention layers, or gradient checkpointing that would drop or detach the prefix
    (`prefix_survives_checkpointing`)."""
    unwrapped = trainer._unwrap(model)
    if trainer.accelerator.distributed_type != DistributedType.NO or unwrapped is not model:
        return None
    if set(getattr(unwrapped.config, "layer_types", None) or ["unknown"]) != {"full_attention"}:
        return None
    if torch.is_grad_enabled() and not prefix_survives_checkpointing(unwrapped):
        return None
    prefix = split_prompt_prefix(input_ids, attention_mask, logits_to_keep)
    if prefix is None:
        return None
    # PEFT's `PeftModel` API, duck-typed: `unwrapped` is already bare, and accelerate's `is_peft_model` unwraps again
    # and re-reads package metadata (~2 ms at every training step).
    backbone = (unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped).base_model
    with trainer.accelerator.autocast():
        return prefix_forward(model, backbone, prefix, attn_implementation, dtype)
