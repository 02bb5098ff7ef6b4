"""The reference page's per-token rule (`benchmarks/reference_page_m2po.py`, benchmark-only: not the published M2PO)
against a derivation by hand, so the page's figures can be set beside ours with a rule we know is the page's."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from benchmarks.reference_page_m2po import reference_page_m2po_loss


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _reference_by_hand(logp, behaviour, adv, mask, gamma, el, eh):
    B, T = len(logp), len(logp[0])
    num, kept, valid = 0.0, 0, 0
    grads = [[0.0] * T for _ in range(B)]
    terms = []
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            valid += 1
            r = math.exp(f32(logp[i][t] - behaviour[i][t]))
            if r * r > gamma:
                continue
            kept += 1
            a = adv[i][t]
            clipped = min(max(r, 1 - el), 1 + eh)
            unclipped_term, clipped_term = r * a, clipped * a
            num += min(unclipped_term, clipped_term)
            # d/dlogp min(r a, clip(r) a): r a when the unclipped branch is the min or clip is inactive.
            clip_active = r > 1 + eh or r < 1 - el
            terms.append((i, t, r * a if (unclipped_term <= clipped_term or not clip_active) else 0.0))
    denom = max(1, kept)
    for i, t, gt in terms:
        grads[i][t] = -gt / denom
    return -num / denom, grads, (valid - kept) / max(valid, 1)


@pytest.mark.parametrize("seed", range(6))
def test_reference_rule_matches_hand_derivation(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 4, 25
    behaviour = -torch.rand(B, T, generator=g) * 2
    # Ratios spread over ~[0.3, 3]: some outside the clip range, some with r^2 > gamma.
    logp = (behaviour + torch.randn(B, T, generator=g) * 0.5).requires_grad_()
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    # Padding carries huge ratios: if padding were kept, the loss would differ.
    with torch.no_grad():
        logp[~mask] = behaviour[~mask] + 0.1
    adv = torch.randn(B, generator=g)
    loss, masked = reference_page_m2po_loss(logp, behaviour, adv, mask, gamma=2.0, epsilon_low=0.2, epsilon_high=0.28)
    loss.backward()
    adv2 = [[adv[i].item()] * T for i in range(B)]
    exp_loss, exp_grad, exp_masked = _reference_by_hand(
        logp.detach().tolist(), behaviour.tolist(), adv2, mask.tolist(), 2.0, 0.2, 0.28
    )
    assert loss.item() == pytest.approx(exp_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logp.grad, torch.tensor(exp_grad), rtol=1e-5, atol=1e-7)
    assert masked == pytest.approx(exp_masked)
    # The case really exercises the masking and both clip sides.
    assert 0 < exp_masked < 1
    d = (logp.detach() - behaviour)[mask]
    assert (d.exp() > 1.28).any() and (d.exp() < 0.8).any()


def test_reference_rule_padding_and_all_masked():
    # Padding is never kept even when its ratio is perfect; all valid tokens with r^2 > gamma -> zero loss.
    logp = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    loss, masked = reference_page_m2po_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
    loss.backward()
    assert loss.item() == 0.0 and masked == 1.0
    assert torch.equal(logp.grad, torch.zeros(1, 3))
