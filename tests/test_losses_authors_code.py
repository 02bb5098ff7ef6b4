"""rule="authors_code" against a transcription of the M2PO authors' training code.

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
import random
import zlib

import pytest
import torch

from trl_async.algorithms.m2po import m2po_loss, m2po_select

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


def _case(rng: random.Random):
    B, T = rng.randint(1, 5), rng.randint(1, 40)
    scale = rng.choice([16, 48, 96])  # |delta| up to about 0.06 .. 0.4, plus outliers
    grid = []
    for _ in range(B * T):
        k = round(rng.gauss(0, scale))
        if rng.random() < 0.08:
            k = rng.choice([-1, 1]) * rng.randint(100, 400)
        grid.append(k / 256)
    lengths = [rng.randint(0, T) for _ in range(B)]
    adv = [rng.choice([-1.0, 1.0]) * (0.05 + rng.random()) if rng.random() < 0.85 else 0.0 for _ in range(B)]
    return B, T, grid, lengths, adv


@pytest.mark.parametrize("floors", [(None, None), (0.3, 0.5), (0.2, None), (None, 0.1)])
def test_authors_code_matches_transcription(floors):
    rng = random.Random(zlib.crc32(repr(floors).encode()))  # a seed per case, the same in every run
    checked = skipped = clipped_cases = 0
    for _ in range(400):
        B, T, grid, lengths, adv = _case(rng)
        budget = rng.choice([0.04, 0.01, 0.1])
        logp_rows = [grid[i * T : (i + 1) * T] for i in range(B)]
        old_rows = [[0.0] * T for _ in range(B)]
        mask_rows = [[t < lengths[i] for t in range(T)] for i in range(B)]
        try:
            exp_loss, exp_grad = authors_m2po_loss(old_rows, logp_rows, adv, mask_rows, budget, *floors)
        except Degenerate:
            skipped += 1
            continue
        logp = torch.tensor(logp_rows, requires_grad=True)
        loss, stats = m2po_loss(
            logp,
            torch.zeros(B, T),
            torch.tensor(adv),
            torch.tensor(mask_rows),
            budget,
            rule="authors_code",
            clip_floor_low=floors[0],
            clip_floor_high=floors[1],
        )
        loss.backward()
        assert loss.item() == pytest.approx(exp_loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(logp.grad, torch.tensor(exp_grad), rtol=1e-5, atol=1e-7)
        held = sum(1 for row in exp_grad for g in row if g == 0.0) - sum(1 for row in mask_rows for m in row if not m)
        zero_adv_tokens = sum(lengths[i] for i in range(B) if adv[i] == 0.0)
        clipped_cases += held > zero_adv_tokens
        checked += 1
    assert skipped < 20 and checked > 350
    assert clipped_cases > 50  # the clip binds in many cases, not only the easy no-clip ones


def test_authors_cut_is_the_breakpoint_below_not_interpolated():
    # Harmful delta^2 = 0.01, 0.04, 0.09 (A > 0, delta > 0), budget 0.04: capping at 0.04 gives (0.01 + 0.04 +
    # 0.04) / 3 = 0.03 <= 0.04 and capping at 0.09 breaks it, so the cut is 0.04: the 0.2 token sits on the cut
    # and is clipped too (their tau = sqrt(0.04 - 1e-12) is just below 0.2).  Interpolating would give
    # tau^2 = 0.07 and clip only the 0.3 token.
    sel = m2po_select(torch.tensor([[0.1, 0.2, 0.3]]), torch.ones(1, 3), 0.04, torch.tensor([1.0]), "authors_code")
    assert sel.keep.tolist() == [[True, False, False]]
    assert sel.stats["clip_log_bound"].item() == pytest.approx(0.2)
    # Transcription agrees.
    _, grad = authors_m2po_loss([[0.0] * 3], [[0.1, 0.2, 0.3]], [1.0], [[True] * 3], 0.04)
    assert [g == 0.0 for g in grad[0]] == [False, True, True]


def test_authors_no_clip_when_budget_holds_and_floors_widen_the_clip():
    # Mean harmful delta^2 = (0.01 + 0.0025) / 2 <= 0.04: no clip, every token keeps its gradient.
    sel = m2po_select(torch.tensor([[0.1, 0.05, -0.9]]), torch.ones(1, 3), 0.04, torch.tensor([1.0]), "authors_code")
    assert sel.keep.all() and sel.clipped is None and math.isinf(sel.stats["clip_log_bound"].item())
    # Budget broken by one harmful token (delta = 0.5): cut 0 -> clipped.  A floor of 0.7 on the high side
    # (ratio bound 1.7 > e^0.5 = 1.65) lets it through again.
    d = torch.tensor([[0.5, -0.3]])
    sel = m2po_select(d, torch.ones(1, 2), 0.04, torch.tensor([1.0]), "authors_code")
    assert sel.keep.tolist() == [[False, True]]
    sel = m2po_select(d, torch.ones(1, 2), 0.04, torch.tensor([1.0]), "authors_code", clip_floor_high=0.7)
    assert sel.keep.tolist() == [[True, True]]
