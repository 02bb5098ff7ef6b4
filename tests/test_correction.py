"""The correction against μ (`trainers.correction`), the one owner for both trainers: each function checked against
the rule written out by hand here, token by token. No model."""

from __future__ import annotations

import math

import pytest
import torch

from trl_async.algorithms.offpolicy import OFFPOLICY_SUM_KEYS
from trl_async.trainers.correction import (
    WEIGHT_SUMS,
    CorrectionSettings,
    apply_to_trl_batch,
    behaviour_correction,
    m2po_correction,
)

LOG2 = math.log(2.0)


def _example():
    # Two rows; row 0 has 3 valid tokens, row 1 has 2. log π_old − log μ per token:
    delta = torch.tensor([[0.0, LOG2, math.log(4.0), 9.0], [-LOG2, 0.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    behaviour = torch.randn(2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return behaviour + delta, behaviour, mask


def test_token_truncate_weights_and_their_figures_by_hand():
    old, behaviour, mask = _example()
    settings = CorrectionSettings(corrects=True, mode="token_truncate", clip_min=None, clip_max=3.0)
    result = behaviour_correction(old, behaviour, mask, settings)
    # w = exp(δ) clamped to 3: row 0: 1, 2, 4 -> 3; row 1: 0.5, 1 (padding: whatever, never counted).
    valid = mask.bool()
    assert result.weights[valid].tolist() == pytest.approx([1.0, 2.0, 3.0, 0.5, 1.0])
    sums = dict(zip(WEIGHT_SUMS, result.weight_sums.tolist(), strict=True))
    assert sums == pytest.approx({"weight_sum": 7.5, "count": 5, "zero": 0, "changed": 1})  # the 4 clamped to 3
    assert (float(result.weight_min), float(result.weight_max)) == pytest.approx((0.5, 3.0))
    off = dict(zip(OFFPOLICY_SUM_KEYS, result.offpolicy_sums.tolist(), strict=True))
    assert off["tokens"] == 5 and off["clipped_tokens"] == 1 and off["masked_tokens"] == 0
    assert off["delta_sq"] == pytest.approx(2 * LOG2**2 + math.log(4.0) ** 2)
    assert off["delta_sq_kept"] == pytest.approx(2 * LOG2**2 + math.log(3.0) ** 2)  # δ' = log of the weight applied


def test_sequence_mask_weights_by_hand():
    old, behaviour, mask = _example()
    settings = CorrectionSettings(corrects=True, mode="sequence_mask", clip_max=3.0)
    result = behaviour_correction(old, behaviour, mask, settings)
    # Σ δ over valid tokens: row 0: log 8 -> 8 > 3: masked to 0; row 1: −log 2 -> 0.5.
    assert result.weights.shape == (2, 1)
    assert result.weights.flatten().tolist() == pytest.approx([0.0, 0.5])
    sums = dict(zip(WEIGHT_SUMS, result.weight_sums.tolist(), strict=True))
    assert sums == pytest.approx({"weight_sum": 0.5, "count": 2, "zero": 1, "changed": 1})


def test_without_the_correction_nothing_is_applied_and_the_diagnostics_remain():
    old, behaviour, mask = _example()
    result = behaviour_correction(old, behaviour, mask, CorrectionSettings(corrects=False))
    assert result.weights is None and result.weight_sums is None
    off = dict(zip(OFFPOLICY_SUM_KEYS, result.offpolicy_sums.tolist(), strict=True))
    assert off["tokens"] == 5 and off["kept_tokens"] == 5 and off["delta_sq"] == off["delta_sq_kept"]


def test_applying_to_a_trl_batch_folds_the_weight_into_the_advantages_or_hands_it_to_vespo():
    old, behaviour, mask = _example()
    settings = CorrectionSettings(corrects=True, mode="token_truncate", clip_max=3.0)
    result = behaviour_correction(old, behaviour, mask, settings)
    batch = {"advantages": torch.tensor([2.0, -1.0], dtype=torch.float64), "other": object()}
    folded = apply_to_trl_batch(batch, result, "dapo")
    assert folded is not batch and batch["advantages"].shape == (2,)  # the caller's batch keeps its advantages
    assert torch.equal(folded["advantages"], torch.tensor([[2.0], [-1.0]], dtype=torch.float64) * result.weights)
    assert folded["other"] is batch["other"]
    vespo = apply_to_trl_batch(batch, result, "vespo")
    assert vespo["importance_sampling_ratio"] is result.weights and vespo["advantages"] is batch["advantages"]
    untouched = apply_to_trl_batch(
        batch, behaviour_correction(old, behaviour, mask, CorrectionSettings(False)), "dapo"
    )
    assert untouched is batch


def test_m2po_correction_keeps_what_algorithm_1_keeps():
    # Candidates: tokens whose ratio moves with their advantage (A > 0, δ > 0). δ² = 0.09, 0.01, 0.25: the mean over the
    # candidates is 0.1167 > 0.04: drop the largest (0.25) -> 0.05 > 0.04: drop 0.09 -> 0.01 ≤ 0.04: stop.
    delta = torch.tensor([[0.3, 0.1, 0.5, -0.2]])
    mask = torch.ones(1, 4)
    advantages = torch.tensor([1.0])
    selection, sums = m2po_correction(delta, mask, advantages, CorrectionSettings(corrects=False, m2po_threshold=0.04))
    assert selection.keep.tolist() == [[False, True, False, True]]  # the token with δ < 0 is not a candidate
    off = dict(zip(OFFPOLICY_SUM_KEYS, sums.tolist(), strict=True))
    assert off["masked_tokens"] == 2 and off["kept_tokens"] == 2
