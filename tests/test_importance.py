"""Truncated importance weights against the behaviour policy, and why folding them into advantages is exact."""

import pytest
import torch

from tests.support.references import reference_weights
from trl_async.algorithms.importance import fold_into_advantages, truncated_importance_weights


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_weights_match_trl_semantics(mode, clip_min, clip_max):
    torch.manual_seed(0)
    current = torch.randn(6, 9, dtype=torch.float64) * 0.5 - 2
    behaviour = current + torch.randn(6, 9, dtype=torch.float64) * 0.4
    mask = (torch.arange(9)[None] < torch.tensor([9, 7, 5, 3, 1, 0])[:, None]).double()
    got = truncated_importance_weights(current, behaviour, mask, mode, clip_min, clip_max)
    want = reference_weights(current, behaviour, mask, mode, clip_min, clip_max)
    assert got.shape == ((6, 1) if mode.startswith("sequence") else (6, 9))
    torch.testing.assert_close(got, want)


def test_unknown_mode_is_rejected():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="token_truncate"):
        truncated_importance_weights(x, x, x, mode="tokens")


def test_folding_weights_into_advantages_equals_weighting_the_clipped_loss():
    """w * -min(r A, clip(r) A) == -min(r (wA), clip(r) (wA)) for w >= 0, the identity the trainer relies on."""
    torch.manual_seed(1)
    ratio = torch.exp(torch.randn(5, 7) * 0.5)
    advantages = torch.randn(5)
    weights = torch.rand(5, 7) * 3
    weights[0, :3] = 0.0  # masked tokens
    eps = 0.2

    def clipped_loss(adv):
        return -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)

    folded = clipped_loss(fold_into_advantages(advantages, weights))
    weighted = clipped_loss(advantages.unsqueeze(1)) * weights
    torch.testing.assert_close(folded, weighted)
    assert fold_into_advantages(advantages, torch.ones(5, 1)).shape == (5, 1)
