"""A transcription of the M2PO authors' training code (the reference of `rule="authors_code"`).

Source (read, then re-written here in plain Python; nothing copied): Infini-AI-Lab/M2PO,
``verl/trainer/ppo/core_algos.py`` at commit 4514ce22cc5af605b150d3bb7d0deab82f783acd, functions
``_get_trust_region_tokens_delta_sq``, ``_solve_tau_from_sorted_delta2``, ``kpo_clip_harmful_tokens`` and
``compute_m2po_policy_loss`` (called per micro-batch by ``verl/workers/actor/dp_actor.py`` with
``old_log_prob`` = the behaviour policy's log-probs, computed when the batch was generated, and
``loss_agg_mode="token-mean"``; ``miniclip_low`` / ``miniclip_high`` come from the config, which no shipped script
sets, so they are None).

The transcription keeps their 1e-12 slacks and their float64 host arithmetic.  Inputs are chosen so that float
rounding cannot decide anything: delta on a 1/256 grid (delta and delta^2 exact in float32 and float64), advantages
0 or at least 0.05 in magnitude, and cases where some comparison falls within 1e-9 of its threshold are skipped
(and counted).
"""

from __future__ import annotations

import math

EPS = 1e-12
NO_CLIP = 100000  # their "no clipping needed" tau


class Degenerate(Exception):
    """A comparison of the authors' code lands within float noise of its threshold: not a fair test case."""


def _near(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def authors_trust_region_delta_sq(old_logp, logp, adv_rows, mask):
    """_get_trust_region_tokens_delta_sq: per row, A = advantages[:, 0]; harmful tokens are valid tokens with
    (A > 1e-12 and r > 1 + 1e-12) or (A < -1e-12 and r < 1 - 1e-12), r = exp(logp - old); returns their
    (old - logp)^2, positive-advantage rows first, then negative ones (the order does not matter: it is sorted)."""
    pos, neg = [], []
    for i, a in enumerate(adv_rows):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            delta = old_logp[i][t] - logp[i][t]
            r = math.exp(-delta)
            if a > EPS and r > 1 + EPS:
                pos.append(delta * delta)
            elif a < -EPS and r < 1 - EPS:
                neg.append(delta * delta)
    return pos + neg


def authors_solve_tau(sorted_d2, target_sum):
    """_solve_tau_from_sorted_delta2: first breakpoint k whose capped sum (with their slacks) reaches the target;
    returns (sqrt(v[k-1] - 1e-12), capped mean at v[k-1]) or (0, mean) when k = 0."""
    n = len(sorted_d2)
    if n == 0:
        return NO_CLIP  # (a bare number: their caller would fail to unpack it; unreachable from kpo_clip)
    total = math.fsum(sorted_d2)
    if target_sum >= total - EPS:
        return NO_CLIP
    if target_sum <= EPS:
        raise Degenerate("their caller cannot unpack this return value")
    csum = 0.0
    prefix = []
    for v in sorted_d2:
        csum += v
        prefix.append(csum)
    for k in range(n):
        rest = n - k - 1
        lhs = (sorted_d2[k] - EPS) * rest + prefix[k]
        if _near(lhs, target_sum - EPS):
            raise Degenerate("capped sum at the target")
        if lhs >= target_sum - EPS:
            if k == 0:
                return 0.0, prefix[-1] / n
            m2_after = (sorted_d2[k - 1] * (rest + 1) + prefix[k - 1]) / n
            return (sorted_d2[k - 1] - EPS) ** 0.5, m2_after
    return NO_CLIP


def authors_clip_bounds(old_logp, logp, adv_rows, mask, budget):
    """kpo_clip_harmful_tokens: (clip_low, clip_high) as ratio bounds exp(-tau), exp(tau); no clip when there is
    no harmful token or their M2 is within budget (+1e-12)."""
    d2 = authors_trust_region_delta_sq(old_logp, logp, adv_rows, mask)
    n = len(d2)
    if n == 0:
        return 0.0, NO_CLIP
    m2_now = math.fsum(d2) / n
    if _near(m2_now, budget + EPS):
        raise Degenerate("M2 at the budget")
    if m2_now <= budget + EPS:
        return 0.0, NO_CLIP
    tau, _ = authors_solve_tau(sorted(d2), budget * n)
    return math.exp(-tau), math.exp(tau)


def authors_m2po_loss(old_logp, logp, adv_rows, mask, budget, miniclip_low=None, miniclip_high=None):
    """compute_m2po_policy_loss with loss_agg_mode="token-mean": returns (loss, d loss / d logp per token)."""
    low_bound, high_bound = authors_clip_bounds(old_logp, logp, adv_rows, mask, budget)
    clip_low = 1 - low_bound  # as eps_low of a PPO clip
    clip_high = high_bound - 1  # (no clip: ratios are still clamped at 1e5, far above these inputs)
    if miniclip_low is not None and clip_low < miniclip_low:
        clip_low = miniclip_low
    if miniclip_high is not None and clip_high < miniclip_high:
        clip_high = miniclip_high
    lo, hi = 1 - clip_low, 1 + clip_high
    total, n_valid = 0.0, 0
    grads = []
    for i, a in enumerate(adv_rows):
        row = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            n_valid += 1
            r = math.exp(logp[i][t] - old_logp[i][t])
            clipped_r = min(max(r, lo), hi)
            loss1, loss2 = -a * r, -a * clipped_r
            total += max(loss1, loss2)
            # d/dlogp max(-A r, -A clip(r)): the unclipped branch when it is the max or the clip is inactive.
            row.append(-a * r if (loss1 >= loss2 or lo < r < hi) else 0.0)
        grads.append(row)
    n = max(n_valid, 1)  # verl's masked_mean divides by the valid tokens
    return total / n, [[g / n for g in row] for row in grads]


# ------------------------------------------------------------------------------------------------------------
