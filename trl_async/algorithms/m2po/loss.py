"""The M2PO loss: J = (1/N) sum_t M_t r_t A_t (``reference.py`` explains the terms), loss = -J.

:func:`m2po_loss` selects the tokens (``fast.py``) unless it is given a selection already made (one micro-batch's part
of ``global_scope.py``'s), then sums the kept tokens' r_t A_t.  Under ``"authors_code"`` the clipped tokens add their
clipped term A_t * bound, without gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fast import m2po_select
from .selection import M2POSelection, _broadcast_advantages


def m2po_loss(
    per_token_logps: Tensor,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    normalizer: Tensor | float | None = None,
    *,
    rule: str = "paper",
    selection: M2POSelection | None = None,
    clip_floor_low: float | None = None,
    clip_floor_high: float | None = None,
    host_memory: bool | None = None,
) -> tuple[Tensor, dict]:
    """M2PO loss (Zheng et al. 2025, arXiv:2510.01161).

    ``delta_t = per_token_logps - behaviour_logps``, ``r_t = exp(delta_t)``, selection by ``rule`` (see
    :func:`m2po_select`), then:

    * ``"paper"`` / ``"all_tokens"``: ``J = (1/N) sum_t M_t r_t A_t`` (no epsilon-clip), ``loss = -J``.
    * ``"authors_code"``: ``J = (1/N) sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)`` over valid tokens, with the clip
      bounds of the selection (none when the budget holds).  Only harmful tokens can be held at a bound; they add
      ``A_t * bound`` without gradient.  The authors average per micro-batch ("token-mean"); pass ``normalizer`` to
      match (the default, the number of valid tokens, does).

    The gradient flows through ``r_t`` of the kept tokens: ``d loss / d per_token_logps_t = -M_t r_t A_t / N``.

    Args:
        per_token_logps: ``log pi_theta``, shape ``(B, T)``, requires grad.
        behaviour_logps: ``log mu`` of the policy that sampled the tokens, same shape.
        advantages: ``(B,)`` (unsqueezed to ``(B, 1)``) or ``(B, T)``.
        mask: valid-token mask, ``(B, T)``.
        threshold: ``tau_M2`` (0.04 in the paper).
        normalizer: N.  The trainer passes TRL ``dapo``'s normaliser.  Default: the number of valid tokens
            before masking, clamped to >= 1.  A non-positive tensor normaliser is replaced by 1 (there is then
            nothing to normalise); a non-positive number raises ``ValueError``.
        rule: ``"paper"`` (default), ``"all_tokens"`` or ``"authors_code"``.
        selection: a selection already made for these tokens (e.g. one micro-batch's part of
            :func:`m2po_select_global`); then ``threshold``, ``rule`` and the floors are not used.
        clip_floor_low, clip_floor_high: ``"authors_code"`` only (see :func:`m2po_select`).
        host_memory: see :func:`m2po_select` (when it selects here).

    Returns:
        ``(loss, stats)``; ``stats`` are the selection's (see :class:`M2POSelection`), detached, no host sync spent
        on them.  When ``all_masked`` the loss is an exact zero that still has a graph (backward gives zero
        gradients); the caller should warn and count it.

    Masked tokens and padding enter neither the value nor the gradient (weight exactly 0).  When some ratio is
    not finite (inf/NaN log-probs, or exp overflow), their ``delta`` is replaced by ``-inf`` before the ``exp``
    instead, so inf * 0 = NaN cannot leak in.  Low-precision log-probs (bf16/fp16) are accumulated in the
    advantages' dtype (float32), as TRL does.
    """
    delta = per_token_logps - behaviour_logps
    adv = _broadcast_advantages(advantages.detach(), delta)
    if selection is None:
        selection = m2po_select(
            delta, mask, threshold, adv, rule, clip_floor_low=clip_floor_low, clip_floor_high=clip_floor_high,
            host_memory=host_memory,
        )  # fmt: skip
        ratios_finite = selection.ratios_finite
    else:
        if selection.keep.shape != delta.shape:
            raise ValueError(
                f"selection is for shape {tuple(selection.keep.shape)}, the loss has {tuple(delta.shape)}"
            )
        ratios_finite = False  # decided on other (pre-pass) values: always guard
    keep = selection.keep

    if selection.clipped is not None:
        # "authors_code" with a binding clip: a clipped token's term is A * bound, a constant (PPO's clip).
        bound = torch.where(delta.detach() > 0, selection.clip_log_high, selection.clip_log_low)
        effective = torch.where(selection.clipped, bound.to(delta.dtype), delta)
        objective_sum = (torch.exp(torch.where(keep | selection.clipped, effective, float("-inf"))) * adv).sum()
    elif ratios_finite:
        # Every exp(delta) is finite (checked in the selection's single sync), so the mask can ride on the
        # advantages: weight 0 on masked tokens and padding, zero value and zero gradient there.
        objective_sum = (torch.exp(delta) * (keep * adv)).sum()
    else:
        # Some ratio is inf/NaN (or would overflow): replace delta by -inf wherever the mask is off, so the
        # ratio there is exactly 0 and inf * 0 = NaN cannot leak into the value or the gradient.
        objective_sum = (torch.exp(torch.where(keep, delta, float("-inf"))) * adv).sum()

    if normalizer is None:
        if selection.n_valid is not None:
            loss = objective_sum * (-1.0 / max(selection.n_valid, 1))
        else:
            valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)
            loss = -objective_sum / valid.sum().clamp(min=1).to(objective_sum.dtype)
    elif isinstance(normalizer, Tensor):
        denom = torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer)).to(objective_sum.dtype)
        loss = -objective_sum / denom
    else:
        if not float(normalizer) > 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer!r}")
        loss = objective_sum * (-1.0 / float(normalizer))
    return loss, selection.stats
