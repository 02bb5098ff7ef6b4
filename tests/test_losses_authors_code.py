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

from tests.support.authors_m2po import (
    Degenerate,
    authors_m2po_loss,
)
from trl_async.algorithms.m2po import m2po_loss, m2po_select


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
