"""The per-token rule the reference page prints as "M2PO": NOT the published M2PO (trl_async.algorithms.m2po).

Benchmark-only: `bench_losses.py` times it beside the published rule, so the page's figures can be set beside ours.
The rule, as the page prints it (DESIGN.md section 6 lists what it gets wrong):

    r_t = exp(logp_t - logmu_t)
    m_t = 1[r_t^2 <= gamma]        on valid tokens only (padding is never kept)
    L   = -(1 / max(1, sum_t m_t)) * sum_t m_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
"""

from __future__ import annotations

import torch
from torch import Tensor


def reference_page_m2po_loss(
    per_token_logps: Tensor,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    gamma: float = 2.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[Tensor, float]:
    """(loss, masked fraction of the valid tokens) of the page's rule. No host sync but the returned fraction."""
    delta = per_token_logps - behaviour_logps
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(delta.device).expand(delta.shape).detach()
    valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)
    keep = valid & (torch.exp(delta.detach()).square() <= gamma)
    safe_delta = torch.where(keep, delta, 0.0)  # dropped tokens: no inf/NaN in forward or backward
    ratio = torch.exp(safe_delta)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -torch.where(keep, per_token, 0.0).sum() / keep.sum().clamp(min=1).to(per_token.dtype)
    masked_fraction = float((valid & ~keep).sum()) / max(int(valid.sum()), 1)
    return loss, masked_fraction
