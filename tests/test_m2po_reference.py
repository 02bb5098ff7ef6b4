"""`m2po_mask_reference` (Algorithm 1, one token at a time, for readers) and the vectorized `m2po_select` agree."""

from __future__ import annotations

import random

import pytest
import torch

from trl_async.algorithms.m2po import m2po_mask_reference, m2po_select


@pytest.mark.parametrize("seed", range(12))
def test_the_readable_reference_equals_the_vectorized_selection(seed):
    rng = random.Random(seed)
    rows, width = rng.randint(1, 6), rng.randint(1, 40)
    spread = rng.choice([0.05, 0.2, 0.6, 1.5])
    delta = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * spread
    if seed % 3 == 0:  # ties: repeated values
        delta = (delta * 4).round() / 4
    lengths = torch.tensor([rng.randint(0, width) for _ in range(rows)])
    mask = torch.arange(width)[None] < lengths[:, None]
    advantages = torch.tensor([rng.choice([-1.0, 0.0, 0.5, 2.0]) for _ in range(rows)])
    tau = rng.choice([0.0, 0.01, 0.04, 0.2])
    expected = m2po_mask_reference(delta, mask, advantages, tau)
    got = m2po_select(delta, mask, tau, advantages, "paper").keep
    assert torch.equal(got, expected)


def test_the_reference_drops_the_largest_trust_region_tokens_first():
    # A > 0: trust-region tokens are those with delta > 0. Mean of 0.5^2, 0.1^2 = 0.13 > 0.04: drop 0.5 first, then
    # 0.1^2 = 0.01 <= 0.04 stops. The negative delta is outside the trust region: never masked, however large.
    delta = torch.tensor([[0.5, 0.1, -3.0, 0.0]])
    keep = m2po_mask_reference(delta, torch.ones(1, 4), torch.tensor([1.0]), 0.04)
    assert keep.tolist() == [[False, True, True, True]]
