"""Importance correction of TRL's loss types against the behaviour policy.

Rows from the queue were sampled by an older policy μ (the weights version that generated them), while TRL's loss
types clip the ratio π_θ / π_old with π_old the *current* policy at batch time. TRL already has a correction for the
same situation, the vLLM sampler/trainer mismatch (`vllm_importance_sampling_correction`): a truncated (or masked)
importance weight w = π_old / μ, per token or per sequence, multiplies the per-token loss. We reuse its semantics and
its knobs (`vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`).

Rather than re-implement TRL's loss to multiply by w, the weight is folded into the advantages: for every TRL loss
type the policy term is positively homogeneous in the advantage, e.g. w · min(r A, clip(r) A) = min(r wA, clip(r) wA)
for w ≥ 0, and the KL and entropy terms do not involve A. TRL's `_compute_loss` accepts per-token advantages (B, T),
so the correction needs no override of TRL's loss at all.
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def truncated_importance_weights(
    current_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """TRL 1.16's importance weight π_old/μ: (B, T) for token modes, (B, 1) for sequence modes.

    Sequence modes use exp(Σ_t log π_old − log μ) over the valid tokens. Truncate modes clamp into
    [clip_min, clip_max]; mask modes set weights outside that range to 0.
    """
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; use one of {IS_MODES}.")
    diff = torch.nan_to_num((current_logps - behaviour_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def fold_into_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Advantages (B,) or (B, T) times non-negative weights (B, 1) or (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages * weights
