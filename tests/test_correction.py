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


# Per token: a ratio above every clip_max used here, one below every clip_min, and ratios well inside [0.1, 2.2].
_RATIOS = [[5.0, 1.0, 0.01, 1.1], [0.5, 8.0, 1.15, 0.02], [0.9, 1.0, 0.3, 0.002]]
_MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize(("clip_min", "clip_max"), [(0.1, 1.2), (None, 2.2), (0.1, 2.2), (0.0, 1.2), (0.0, 3.0)])
def test_truncated_weights_on_a_bound_are_counted_as_clipped_in_their_own_dtype(clip_min, clip_max):
    # float32 weights clamped to 1.2 hold float32(1.2), which a float64 1.2 never equals; and 0.0 is a bound too (a
    # ratio that underflows to 0 is held there). TRL's clipped fraction must count each token clamped, as
    # offpolicy/clipped_fraction does. Expected counts from the ratios, by hand.
    delta = torch.tensor([[math.log(r) for r in row] for row in _RATIOS], dtype=torch.float32)
    delta[2, 3] = -200.0  # exp underflows to exactly 0 in float32
    mask = torch.tensor(_MASK, dtype=torch.float32)
    behaviour = torch.zeros_like(delta)
    settings = CorrectionSettings(corrects=True, mode="token_truncate", clip_min=clip_min, clip_max=clip_max)
    result = behaviour_correction(delta, behaviour, mask, settings)
    ratios = [r for row in _RATIOS for r in row]
    ratios[11] = math.exp(-200.0)  # row 2, column 3
    valid = [bool(v) for row in _MASK for v in row]
    low = clip_min if clip_min is not None else -math.inf
    held_at_zero = [r < 1e-30 and clip_min == 0.0 for r in ratios]  # exp(-200) is 0 in float32: on the bound 0.0
    expected = sum(v and (r > clip_max or r < low or z) for r, v, z in zip(ratios, valid, held_at_zero, strict=True))
    sums = dict(zip(WEIGHT_SUMS, result.weight_sums.tolist(), strict=True))
    off = dict(zip(OFFPOLICY_SUM_KEYS, result.offpolicy_sums.tolist(), strict=True))
    assert sums["changed"] == expected > 0
    assert off["clipped_tokens"] == sums["changed"]  # sampling/.../clipped_fraction == offpolicy/clipped_fraction


@pytest.mark.parametrize(("clip_min", "clip_max"), [(0.1, 1.2), (0.1, 2.2)])
def test_truncated_sequence_weights_on_a_bound_are_counted_per_row(clip_min, clip_max):
    # Σδ per row: log 5 + ... -> the row ratios are the products of _RATIOS' valid entries.
    delta = torch.tensor([[math.log(r) for r in row] for row in _RATIOS], dtype=torch.float32)
    mask = torch.tensor(_MASK, dtype=torch.float32)
    settings = CorrectionSettings(corrects=True, mode="sequence_truncate", clip_min=clip_min, clip_max=clip_max)
    result = behaviour_correction(delta, torch.zeros_like(delta), mask, settings)
    rows = [
        math.prod(r for r, v in zip(row, valid, strict=True) if v) for row, valid in zip(_RATIOS, _MASK, strict=True)
    ]
    expected = sum(r > clip_max or r < clip_min for r in rows)
    sums = dict(zip(WEIGHT_SUMS, result.weight_sums.tolist(), strict=True))
    assert sums["changed"] == expected > 0
    off = dict(zip(OFFPOLICY_SUM_KEYS, result.offpolicy_sums.tolist(), strict=True))
    clipped_rows_tokens = sum(sum(m) for r, m in zip(rows, _MASK, strict=True) if r > clip_max or r < clip_min)
    assert off["clipped_tokens"] == clipped_rows_tokens
