"""The correction against the behaviour policy μ: the one place both trainers get it from.

Every row of an asynchronous run was sampled by μ, the weights version that generated it under the processed sampling
distribution (`sampling_per_token_logps`, `trainers.batch`), and enters the loss of a newer policy. Per valid
completion token t, δ_t = log π(y_t) − log μ(y_t). What the loss does about it, by configuration:

* **TRL's truncated importance weight** (TRL's loss types in `AsyncGRPOTrainer`, PPO-clip in `AsyncPPOTrainer`; rows
  that can be stale, `max_staleness > 0`, with `vllm_importance_sampling_correction` on, TRL's default):
  w = π_old / μ per token or per sequence, truncated into [clip_min, clip_max] or masked to 0 outside it
  (`algorithms.importance.truncated_importance_weights`, TRL 1.16's `vllm_importance_sampling_*` semantics).
  `behaviour_correction` computes it; `apply_to_trl_batch` applies it to a TRL batch as TRL applies its vLLM weight
  (folded into the advantages, or VESPO's `importance_sampling_ratio`; the proof is in `algorithms.importance`);
  PPO's loss multiplies by it (`algorithms.ppo.ppo_policy_loss`).
* **M2PO** (`loss_type="m2po"`, both trainers): δ against π_θ of the loss itself, tokens masked by the second-moment
  rule (`algorithms.m2po`); `m2po_correction`.
* **Nothing** (on-policy by configuration, or the correction turned off): the diagnostics only.

π_old is the policy at the start of the optimizer step: for PPO, and for a GRPO batch used over several optimizer
steps, TRL's (or PPO's) `old_per_token_logps` computed at batch time; for a GRPO batch used within one step, the
loss's own forward, detached (no forward beyond TRL's own). That last case is the one place TRL's call order forces a
hook: TRL's `_compute_loss` runs the forward and then reads the advantages (`trl_contract.CALL_ORDER`), so the
mixin's forward override applies the correction to the batch in between (`AsyncRolloutMixin._correct_at_forward`).

Each function returns what the loss applies and the sums of its `offpolicy/*` and importance-weight figures; the
trainers record the sums (`trainers.statistics`). Pure tensor code: `tests/test_correction.py`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..algorithms.importance import fold_into_advantages, truncated_importance_weights, weights_on_a_bound
from ..algorithms.m2po import M2POSelection, m2po_select, m2po_select_global
from ..algorithms.offpolicy import importance_weight_sums, m2po_offpolicy_sums, offpolicy_sums

# The importance-weight figures of one batch (`weight_figures`): sums over the weights applied, their extremes.
WEIGHT_SUMS = ("weight_sum", "count", "zero", "changed")


@dataclasses.dataclass(frozen=True)
class CorrectionSettings:
    """What the correction does, from the trainer's mode and config (the same on every rank, whatever its batch)."""

    corrects: bool  # TRL's truncated weight applies (rollout rows that can be stale, the correction on)
    mode: str = "sequence_mask"  # vllm_importance_sampling_mode
    clip_min: float | None = None
    clip_max: float | None = 3.0
    # M2PO (`loss_type="m2po"`)
    m2po_threshold: float = 0.04
    m2po_rule: str = "paper"
    m2po_global: bool = False  # select over the whole optimizer batch of every rank (m2po_scope="global", training)
    m2po_clip_floor_low: float | None = None
    m2po_clip_floor_high: float | None = None

    @classmethod
    def from_args(cls, args, corrects: bool, m2po_global: bool = False) -> CorrectionSettings:
        return cls(
            corrects=corrects,
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
            m2po_threshold=getattr(args, "m2po_threshold", 0.04),
            m2po_rule=getattr(args, "m2po_rule", "paper"),
            m2po_global=m2po_global,
            m2po_clip_floor_low=getattr(args, "m2po_clip_floor_low", None),
            m2po_clip_floor_high=getattr(args, "m2po_clip_floor_high", None),
        )


@dataclasses.dataclass
class BehaviourCorrection:
    """What a batch's correction against μ applies, and its figures."""

    weights: Tensor | None  # π_old/μ, (B, T) in token modes or (B, 1) in sequence modes; None: nothing applied
    offpolicy_sums: Tensor  # `OFFPOLICY_SUM_KEYS` of the batch (float64)
    weight_sums: Tensor | None  # `WEIGHT_SUMS` of the weights applied (float64), None without weights
    weight_min: Tensor | None  # the smallest and largest weight applied (float64 scalars)
    weight_max: Tensor | None


def behaviour_correction(
    old_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, settings: CorrectionSettings
) -> BehaviourCorrection:
    """TRL's truncated importance weight w = π_old/μ where `settings.corrects`, and the figures of δ = log π_old −
    log μ either way (nothing masked or clipped without the weight)."""
    old_logps, behaviour_logps = old_logps.detach(), behaviour_logps.detach()
    delta = old_logps - behaviour_logps
    if not settings.corrects:
        return BehaviourCorrection(None, offpolicy_sums(delta, mask), None, None, None)
    weights = truncated_importance_weights(
        old_logps, behaviour_logps, mask, mode=settings.mode, clip_min=settings.clip_min, clip_max=settings.clip_max
    )
    sums = importance_weight_sums(
        delta, mask, weights, mode=settings.mode, clip_min=settings.clip_min, clip_max=settings.clip_max
    )
    weight_sums, low, high = weight_figures(weights, mask, settings)
    return BehaviourCorrection(weights, sums, weight_sums, low, high)


def weight_figures(weights: Tensor, mask: Tensor, settings: CorrectionSettings) -> tuple[Tensor, Tensor, Tensor]:
    """TRL's `sampling/importance_sampling_ratio/*` figures of the weights applied, as sums (`WEIGHT_SUMS`), min and
    max: every valid token's weight in token modes, every row with a valid token in sequence modes; "changed" counts
    the weights the truncation set to 0 (mask modes) or clamped to a bound (truncate modes; a ratio exactly on a bound
    has probability zero)."""
    mask = mask.bool()
    counted = mask.any(dim=1, keepdim=True) if weights.size(1) == 1 else mask
    weights = weights.detach()
    if settings.mode.endswith("mask"):
        changed = weights == 0
    else:
        changed = weights_on_a_bound(weights, settings.clip_min, settings.clip_max)  # in their own dtype
    weights = weights.to(torch.float64)
    sums = torch.stack(
        [
            torch.where(counted, weights, 0.0).sum(),
            counted.sum().double(),
            (counted & (weights == 0)).sum().double(),
            (counted & changed).sum().double(),
        ]
    )
    return sums, torch.where(counted, weights, torch.inf).min(), torch.where(counted, weights, -torch.inf).max()


def apply_to_trl_batch(inputs: dict, correction: BehaviourCorrection, loss_type: str) -> dict:
    """The batch TRL's `_compute_loss` reads, with the weight applied as TRL applies its vLLM weight: VESPO takes it
    inside φ (`importance_sampling_ratio`); every other TRL loss multiplies its per-token policy loss by w, which equals
    scaling the advantages by w (each policy term is positively homogeneous in A and w ≥ 0: `algorithms.importance`).
    A new dict: the caller's batch (TRL's buffer) keeps its advantages. Unchanged without a weight."""
    if correction.weights is None:
        return inputs
    corrected = dict(inputs)
    if loss_type == "vespo":
        corrected["importance_sampling_ratio"] = correction.weights
    else:
        corrected["advantages"] = fold_into_advantages(inputs["advantages"], correction.weights)
    return corrected


def m2po_correction(
    delta: Tensor, mask: Tensor, advantages: Tensor, settings: CorrectionSettings
) -> tuple[M2POSelection, Tensor]:
    """M2PO's token selection for δ = log π_θ − log μ (detached), over this micro-batch or over the whole optimizer
    batch of every rank (`settings.m2po_global`), and the `offpolicy/*` sums of what it keeps."""
    advantages = advantages.detach().unsqueeze(1) if advantages.dim() == 1 else advantages.detach()
    floors = dict(clip_floor_low=settings.m2po_clip_floor_low, clip_floor_high=settings.m2po_clip_floor_high)
    select = m2po_select_global if settings.m2po_global else m2po_select
    selection = select(delta, mask, settings.m2po_threshold, advantages, settings.m2po_rule, **floors)
    return selection, m2po_offpolicy_sums(delta, mask, selection)


__all__ = [
    "WEIGHT_SUMS",
    "BehaviourCorrection",
    "CorrectionSettings",
    "apply_to_trl_batch",
    "behaviour_correction",
    "m2po_correction",
    "weight_figures",
]
