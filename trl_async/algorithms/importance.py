"""Importance correction of TRL's loss types against the behaviour policy.

Rows from the queue were sampled by an older policy μ (the weights version that generated them, under the processed
sampling distribution), while TRL's loss types clip the ratio π_θ / π_old with π_old the *current* policy at batch time.
TRL already has a correction for the same situation, the vLLM sampler/trainer mismatch
(`vllm_importance_sampling_correction`): a truncated (or masked) importance weight w = π_old / μ, per token or per
sequence, multiplies the per-token policy loss (VESPO instead takes it inside its φ). We reuse its semantics and its
knobs (`vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`).

Where π_old comes from (no forward beyond TRL's own): when a batch is used within one optimizer step (TRL's default
schedule), π_old is π_θ of the loss's own forward, detached; when it spans several steps, TRL computes
`old_per_token_logps` anyway and they are used.

How w enters each TRL 1.16 loss (w ≥ 0; r = π_θ/π_old; A the advantage; ℓ the per-token policy loss TRL multiplies
by w on its vLLM path):

* grpo, bnpo, dr_grpo, dapo, luspo: ℓ = −min(r·A, clip(r)·A). For w ≥ 0, w·min(x, y) = min(w·x, w·y), so
  w·ℓ(A) = ℓ(w·A): folding w into the advantages is exact.
* cispo: ℓ = −sg(min(r, ε_high))·A·log π_θ, linear in A: w·ℓ(A) = ℓ(w·A).
* sapo: ℓ = −σ(τ_A·(r − 1))·4/τ_A·A with τ_A chosen by the sign of A. sign(w·A) = sign(A) for w > 0, so
  w·ℓ(A) = ℓ(w·A); for w = 0 both sides are 0.
* vespo: φ depends on the ratio itself; TRL feeds w through `importance_sampling_ratio` into φ and does not multiply
  the loss, so that is what we do (no folding).
* The KL and entropy terms do not involve A, and TRL's vLLM path multiplies only the policy term: folding leaves them
  untouched too. TRL's `_compute_loss` accepts per-token advantages (B, T).

`tests/test_importance_trainer.py` checks each case: loss and gradients equal TRL's own vLLM-path loss given the same
weights.
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


def weights_on_a_bound(weights: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Where a truncated weight (truncate modes) sits on a bound, i.e. was clamped (a ratio exactly on a bound has
    probability zero). Compared in the weights' own dtype, as `torch.clamp` set them: weights upcast first would miss
    bounds such as 1.2 (float32(1.2) != 1.2). A bound of 0.0 is a bound. The bounds stay Python numbers (a tensor of
    them would be a host-to-device copy, a sync on an accelerator)."""
    on_bound = torch.zeros_like(weights, dtype=torch.bool)
    for bound in (clip_min, clip_max):
        if bound is not None:
            on_bound |= weights == bound
    return on_bound


def fold_into_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Advantages (B,) or (B, T) times non-negative weights (B, 1) or (B, T)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages * weights
