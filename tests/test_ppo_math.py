"""PPO math (trl_async.algorithms.ppo) against independent re-derivations.

References used here, never the code under test: plain Python loops over rows and tokens, numpy statistics, and
small examples worked out by hand with the arithmetic in the comments.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_async.algorithms.importance import truncated_importance_weights
from trl_async.algorithms.ppo import (
    explained_variance,
    gae,
    kl_shaped_rewards,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_kl,
    ppo_policy_loss,
    value_loss,
)

GARBAGE = (float("nan"), float("inf"), -float("inf"), 1e30, -7.0)


def prefix_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def random_batch(seed, lengths, T, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), T, generator=gen, dtype=dtype)
    values = torch.randn(len(lengths), T, generator=gen, dtype=dtype)
    return rewards, values, prefix_mask(lengths, T)


def fill_padding(tensor, mask, fill):
    return torch.where(mask, tensor, torch.full_like(tensor, fill))


# ------------------------------------------------------------------------------------------------------ GAE


def reference_gae(rewards, values, lengths, gamma, lam):
    """Plain Python, one row and one token at a time: Schulman et al. 2016, eq. 16, with V = 0 after the end."""
    B, T = len(rewards), len(rewards[0])
    advantages = [[0.0] * T for _ in range(B)]
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        for t in range(n):
            total = 0.0
            for k in range(t, n):  # the explicit sum Σ_l (γλ)^l δ_{t+l}, not the recursion
                next_value = values[b][k + 1] if k + 1 < n else 0.0
                delta = rewards[b][k] + gamma * next_value - values[b][k]
                total += (gamma * lam) ** (k - t) * delta
            advantages[b][t] = total
            returns[b][t] = total + values[b][t]
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.95), (1.0, 0.0), (1.0, 1.0), (0.9, 1.0), (0.0, 0.5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_python_loop(gamma, lam, seed):
    lengths = [7, 0, 3, 1, 7, 5, 0]  # full rows, empty rows, a single token
    rewards, values, mask = random_batch(seed, lengths, 7)
    # Garbage on padding must not matter.
    rewards, values = fill_padding(rewards, mask, float("nan")), fill_padding(values, mask, 1e30)
    got = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = reference_gae(
        torch.nan_to_num(rewards).tolist(), torch.nan_to_num(values).tolist(), lengths, gamma, lam
    )
    torch.testing.assert_close(got.advantages, want_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.returns, want_ret, rtol=1e-12, atol=1e-12)


def test_gae_lambda_zero_is_td0():
    lengths = [5, 2, 0, 5]
    rewards, values, mask = random_batch(3, lengths, 5)
    got = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    for b, n in enumerate(lengths):
        for t in range(5):
            if t >= n:
                assert got.advantages[b, t] == 0.0
                continue
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0  # terminal after the last valid token
            delta = rewards[b, t].item() + 0.9 * next_value - values[b, t].item()
            assert got.advantages[b, t].item() == pytest.approx(delta, abs=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_gae_lambda_one_is_monte_carlo(gamma):
    lengths = [6, 4, 1, 0]
    rewards, values, mask = random_batch(4, lengths, 6)
    got = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            mc_return = sum(gamma ** (k - t) * rewards[b, k].item() for k in range(t, n))
            assert got.returns[b, t].item() == pytest.approx(mc_return, abs=1e-12)
            assert got.advantages[b, t].item() == pytest.approx(mc_return - values[b, t].item(), abs=1e-12)


def test_gae_worked_example():
    # γ = 1, λ = 0.5, rewards [0, 0, 1], values [0.5, 0.25, 0.75], then one padding slot.
    # δ_2 = 1 + 0 - 0.75 = 0.25                 (terminal: V_3 = 0)
    # δ_1 = 0 + 0.75 - 0.25 = 0.5
    # δ_0 = 0 + 0.25 - 0.5 = -0.25
    # A_2 = 0.25;  A_1 = 0.5 + 0.5·0.25 = 0.625;  A_0 = -0.25 + 0.5·0.625 = 0.0625
    # R = A + V = [0.5625, 0.875, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.25, 0.75, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    got = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert got.advantages.tolist() == [[0.0625, 0.625, 0.25, 0.0]]
    assert got.returns.tolist() == [[0.5625, 0.875, 1.0, 0.0]]


def test_gae_outputs_are_detached_and_at_least_float32():
    rewards, values, mask = random_batch(5, [3, 2], 4, dtype=torch.bfloat16)
    values.requires_grad_(True)
    got = gae(rewards, values, mask, 1.0, 0.95)
    assert got.advantages.dtype == torch.float32 and not got.returns.requires_grad


def test_gae_rejects_bad_knobs():
    rewards, values, mask = random_batch(0, [2], 2)
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, mask, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="lam"):
        gae(rewards, values, mask, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="mask"):
        gae(rewards, values, mask[:, :1], gamma=1.0, lam=0.9)


FLOATS = st.floats(-5, 5, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def padded_batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    rewards = torch.tensor(draw(st.lists(st.lists(FLOATS, min_size=T, max_size=T), min_size=B, max_size=B)))
    values = torch.tensor(draw(st.lists(st.lists(FLOATS, min_size=T, max_size=T), min_size=B, max_size=B)))
    gamma = draw(st.floats(0, 1))
    lam = draw(st.floats(0, 1))
    return rewards.double(), values.double(), prefix_mask(lengths, T), gamma, lam


@settings(max_examples=200, deadline=None)
@given(batch=padded_batches(), extra=st.integers(0, 3), fill=st.sampled_from(GARBAGE))
def test_gae_padding_never_matters(batch, extra, fill):
    rewards, values, mask, gamma, lam = batch
    base = gae(rewards, values, mask, gamma, lam)
    # Append `extra` padding columns and overwrite every padding entry with garbage.
    wide_mask = torch.nn.functional.pad(mask, (0, extra), value=False)
    wide_rewards = fill_padding(torch.nn.functional.pad(rewards, (0, extra)), wide_mask, fill)
    wide_values = fill_padding(torch.nn.functional.pad(values, (0, extra)), wide_mask, fill)
    wide = gae(wide_rewards, wide_values, wide_mask, gamma, lam)
    T = rewards.shape[1]
    assert torch.equal(wide.advantages[:, :T], base.advantages)
    assert torch.equal(wide.returns[:, :T], base.returns)
    assert not wide.advantages[~wide_mask].any() and not wide.returns[~wide_mask].any()


@settings(max_examples=200, deadline=None)
@given(batch=padded_batches())
def test_gae_returns_are_advantages_plus_values(batch):
    rewards, values, mask, gamma, lam = batch
    got = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(got.returns[mask], got.advantages[mask] + values[mask], rtol=0, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(batch=padded_batches(), data=st.data())
def test_gae_is_linear_in_rewards(batch, data):
    rewards, values, mask, gamma, lam = batch
    other = torch.tensor(data.draw(st.lists(FLOATS, min_size=rewards.numel(), max_size=rewards.numel())))
    other = other.double().reshape(rewards.shape)
    scale = data.draw(st.floats(-3, 3))
    zero = torch.zeros_like(values)
    # A(r1 + c·r2, V) = A(r1, V) + c·A(r2, 0): the advantages are linear in the rewards for fixed values.
    combined = gae(rewards + scale * other, values, mask, gamma, lam).advantages
    parts = gae(rewards, values, mask, gamma, lam).advantages + scale * gae(other, zero, mask, gamma, lam).advantages
    torch.testing.assert_close(combined, parts, rtol=1e-9, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(batch=padded_batches())
def test_gae_matches_python_loop_property(batch):
    rewards, values, mask, gamma, lam = batch
    lengths = mask.sum(-1).tolist()
    want_adv, want_ret = reference_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    got = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(got.advantages, want_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.returns, want_ret, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------------------- KL-shaped rewards


def test_kl_shaped_rewards_k1_by_hand():
    # Row 0: 3 valid tokens, score 2.0, β = 0.1.
    #   k1 KL = log π_old - log π_ref = [-1.0 - (-1.5), -2.0 - (-1.0), -0.5 - (-0.5)] = [0.5, -1.0, 0.0]
    #   r = -0.1 · KL = [-0.05, 0.1, 0.0], plus the score on the last valid token (t = 2) -> [-0.05, 0.1, 2.0]
    # Row 1: empty, score 5.0 -> no token to carry it: all 0.
    # Row 2: one valid token, KL = -0.2 - (-0.7) = 0.5 -> r = -0.05 + (-1.0) = -1.05.
    # Padding holds garbage (NaN / inf) that must not leak.
    nan, inf = float("nan"), float("inf")
    policy = torch.tensor([[-1.0, -2.0, -0.5, nan], [nan, inf, 0.0, 0.0], [-0.2, -inf, nan, 3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -inf], [nan, nan, 1.0, 1.0], [-0.7, 0.0, 0.0, nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    scores = torch.tensor([2.0, 5.0, -1.0], dtype=torch.float64)
    got = kl_shaped_rewards(scores, policy, ref, mask, kl_coef=0.1)
    want_kl = [[0.5, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]
    want_rewards = [[-0.05, 0.1, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.05, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(got.kl, torch.tensor(want_kl, dtype=torch.float64))
    torch.testing.assert_close(got.rewards, torch.tensor(want_rewards, dtype=torch.float64))


def test_kl_shaped_rewards_k3_by_hand():
    # log ρ = log π_ref - log π_old = [-1.5 + 1.0, -1.0 + 2.0] = [-0.5, 1.0]
    # k3 = (ρ - 1) - log ρ = [e^-0.5 - 1 + 0.5, e^1 - 1 - 1] = [0.1065306597, 0.7182818285]
    # r = -0.5 · k3, plus score 1.0 on t = 1 (the last valid token of a full row)
    policy = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    got = kl_shaped_rewards(torch.tensor([1.0], dtype=torch.float64), policy, ref, mask, 0.5, kl_estimator="k3")
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert got.kl[0].tolist() == pytest.approx(k3, abs=1e-12)
    assert got.rewards[0].tolist() == pytest.approx([-0.5 * k3[0], -0.5 * k3[1] + 1.0], abs=1e-12)


def test_kl_shaped_rewards_detached_and_validated():
    policy = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    got = kl_shaped_rewards(torch.ones(2), policy, torch.zeros(2, 3), mask, 0.05)
    assert not got.rewards.requires_grad and not got.kl.requires_grad
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_shaped_rewards(torch.ones(2), policy, torch.zeros(2, 3), mask, 0.05, kl_estimator="k2")
    with pytest.raises(ValueError, match="kl_coef"):
        kl_shaped_rewards(torch.ones(2), policy, torch.zeros(2, 3), mask, -1.0)
    with pytest.raises(ValueError, match="scores"):
        kl_shaped_rewards(torch.ones(3), policy, torch.zeros(2, 3), mask, 0.05)


def test_per_token_kl_estimators_by_hand():
    # p = sampling policy, q = the other one; log r = log q - log p = -0.3 - (-0.1) = -0.2
    # k1 = 0.2;  k2 = ½ · 0.04 = 0.02;  k3 = e^-0.2 - 1 + 0.2 = 0.0187307531
    logp = torch.tensor([[-0.1, 0.0]], dtype=torch.float64)
    logq = torch.tensor([[-0.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    assert per_token_kl(logp, logq, mask, "k1")[0].tolist() == pytest.approx([0.2, 0.0], abs=1e-12)
    assert per_token_kl(logp, logq, mask, "k2")[0].tolist() == pytest.approx([0.02, 0.0], abs=1e-12)
    assert per_token_kl(logp, logq, mask, "k3")[0].tolist() == pytest.approx([math.exp(-0.2) - 0.8, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="k4"):
        per_token_kl(logp, logq, mask, "k4")


# ------------------------------------------------------------------------------------------------ value loss


def test_value_loss_clip_by_hand():
    # c = 0.2, mask [1, 1, 0] (the last slot is padding with garbage).
    # t=0: V=1.5, V_old=1.0, R=2.0. unclipped (1.5-2)² = 0.25; clip(1.5, 0.8, 1.2) = 1.2 -> (1.2-2)² = 0.64.
    #      max = 0.64: the clipped term is active, so dL/dV_0 = 0.
    # t=1: V=0.0, V_old=0.1, R=-1.0. unclipped (0+1)² = 1; clip(0, -0.1, 0.3) = 0 -> 1. max = 1, not clipped.
    # L = ½ · (0.64 + 1) / 2 = 0.41;  clipfrac = 1/2.
    # dL/dV_1 = ½ · (1/2) · 2 (V_1 - R_1) = ½ · 1 = 0.5.
    values = torch.tensor([[1.5, 0.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    old_values = torch.tensor([[1.0, 0.1, float("inf")]], dtype=torch.float64)
    returns = torch.tensor([[2.0, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    got = value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    assert got.loss.item() == pytest.approx(0.41, abs=1e-12)
    assert got.clipfrac.item() == 0.5
    got.loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0], abs=1e-12)


def test_value_loss_clip_pulls_back_when_moving_away_is_worse():
    # V moved below V_old - c, away from R: t=0: V=0.5, V_old=1.0, R=0.0. unclipped (0.5)² = 0.25;
    # clip(0.5, 0.8, 1.2) = 0.8 -> 0.64. max = 0.64 (clipped, zero gradient).
    # The unclipped branch wins when V moved towards R beyond the clip: V=0.5, V_old=1.0, R=2.0:
    # unclipped 2.25, clipped (0.8 - 2)² = 1.44 -> max = 2.25, gradient (V-R) / N = -1.5 / 2 = -0.75.
    values = torch.tensor([[0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    got = value_loss(values, old_values, returns, torch.ones(1, 2), 0.2)
    assert got.loss.item() == pytest.approx(0.5 * (0.64 + 2.25) / 2, abs=1e-12)
    assert got.clipfrac.item() == 0.5
    got.loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, -0.75], abs=1e-12)


def test_value_loss_unclipped_and_normalizer():
    # No clip: ½ · ((1.5-2)² + (0+1)²) = ½ · 1.25 = 0.625, over N = 2 -> 0.3125; with normalizer 5 -> 0.125.
    values = torch.tensor([[1.5, 0.0, 7.0]], dtype=torch.float64)
    old_values = torch.tensor([[1.0, 0.1, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    got = value_loss(values, old_values, returns, mask, cliprange_value=None)
    assert got.loss.item() == pytest.approx(0.3125, abs=1e-12) and got.clipfrac.item() == 0.0
    assert value_loss(values, old_values, returns, mask, None, normalizer=5).loss.item() == pytest.approx(0.125)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(values, old_values, returns, mask, cliprange_value=0.0)


def test_value_loss_against_loop():
    gen = torch.Generator().manual_seed(7)
    lengths, T, c = [5, 0, 2, 5], 5, 0.2
    mask = prefix_mask(lengths, T)
    values, old_values, returns = (torch.randn(4, T, generator=gen, dtype=torch.float64) for _ in range(3))
    got = value_loss(values, old_values, returns, mask, c)
    total, clipped, n = 0.0, 0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            v, v_old, r = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
            v_clip = min(max(v, v_old - c), v_old + c)
            total += max((v - r) ** 2, (v_clip - r) ** 2)
            clipped += (v_clip - r) ** 2 > (v - r) ** 2
            n += 1
    assert got.loss.item() == pytest.approx(0.5 * total / n, abs=1e-12)
    assert got.clipfrac.item() == pytest.approx(clipped / n, abs=1e-12)


# ----------------------------------------------------------------------------------------------- policy loss


def policy_example():
    # Four valid tokens and one padding slot (garbage), ε = 0.2:
    #   t  ρ     A    -Aρ    -A·clip(ρ)          max    clipped?
    #   0  1.5   1   -1.5    -1.2 (clip 1.2)     -1.2   yes
    #   1  0.5   1   -0.5    -0.8 (clip 0.8)     -0.5   no
    #   2  0.5  -2    1.0     1.6 (clip 0.8)      1.6   yes
    #   3  1.0   3   -3.0    -3.0                -3.0   no
    # L = (-1.2 - 0.5 + 1.6 - 3.0) / 4 = -3.1 / 4 = -0.775;  clipfrac = 2/4.
    # dL/dlog π_t = -A_t ρ_t / N on unclipped tokens: t=1: -0.5/4 = -0.125, t=3: -3/4 = -0.75; else 0.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, float("nan")]], dtype=torch.float64)
    ratios = [1.5, 0.5, 0.5, 1.0]
    logps = torch.tensor([[-1.0 + math.log(r) for r in ratios] + [float("inf")]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -2.0, 3.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logps.requires_grad_(True), old, advantages, mask, ratios


def test_policy_loss_by_hand():
    logps, old, advantages, mask, ratios = policy_example()
    got = ppo_policy_loss(logps, old, advantages, mask, cliprange=0.2)
    assert got.loss.item() == pytest.approx(-0.775, abs=1e-12)
    assert got.clipfrac.item() == 0.5
    # approx_kl (k3 default) = mean of (ρ - 1) - log ρ over the valid tokens.
    k3 = [(r - 1) - math.log(r) for r in ratios]
    assert got.approx_kl.item() == pytest.approx(sum(k3) / 4, abs=1e-12)
    got.loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, -0.125, 0.0, -0.75, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", lambda r: -math.log(r)),  # KL(π_old ‖ π_θ) with samples from π_old: log π_old - log π_θ
        ("k2", lambda r: 0.5 * math.log(r) ** 2),
        ("k3", lambda r: (r - 1) - math.log(r)),
    ],
)
def test_policy_approx_kl_estimators(estimator, per_token):
    logps, old, advantages, mask, ratios = policy_example()
    got = ppo_policy_loss(logps, old, advantages, mask, 0.2, approx_kl_estimator=estimator)
    assert got.approx_kl.item() == pytest.approx(sum(per_token(r) for r in ratios) / 4, abs=1e-12)
    assert not got.approx_kl.requires_grad and not got.clipfrac.requires_grad


def test_policy_loss_token_truncated_importance_weights_by_hand():
    # Behaviour log-probs μ: log π_old - log μ = [0.0, log 2, log 4, -log 2] -> w = [1, 2, 4 -> 3 (cap), 0.5].
    # L = (1·(-1.2) + 2·(-0.5) + 3·1.6 + 0.5·(-3.0)) / 4 = (-1.2 - 1.0 + 4.8 - 1.5) / 4 = 1.1 / 4 = 0.275
    # Gradient on unclipped tokens: w_t · (-A_t ρ_t) / N: t=1: 2 · -0.125 = -0.25, t=3: 0.5 · -0.75 = -0.375.
    logps, old, advantages, mask, _ = policy_example()
    behaviour = old - torch.tensor([[0.0, math.log(2), math.log(4), -math.log(2), 0.0]], dtype=torch.float64)
    weights = truncated_importance_weights(old, behaviour, mask.double(), mode="token_truncate")
    assert weights[0, :4].tolist() == pytest.approx([1.0, 2.0, 3.0, 0.5])
    got = ppo_policy_loss(logps, old, advantages, mask, 0.2, importance_weights=weights)
    assert got.loss.item() == pytest.approx(0.275, abs=1e-12)
    assert got.clipfrac.item() == 0.5  # the clip statistics are not weighted
    got.loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, -0.25, 0.0, -0.375, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("shift", "want_weight"),
    [
        (math.log(2.5) / 4, 2.5),  # Σ_t (log π_old - log μ) = log 2.5 -> w = 2.5 ≤ 3: kept
        (math.log(3.5) / 4, 0.0),  # w = 3.5 > 3: the whole sequence is masked
    ],
)
def test_policy_loss_sequence_masked_importance_weights_by_hand(shift, want_weight):
    # Sequence weight w = exp(Σ_valid (log π_old - log μ)), masked to 0 outside [None, 3]; L = w · (-0.775).
    logps, old, advantages, mask, _ = policy_example()
    behaviour = old - shift
    weights = truncated_importance_weights(old, behaviour, mask.double(), mode="sequence_mask")
    got = ppo_policy_loss(logps, old, advantages, mask, 0.2, importance_weights=weights)
    assert got.loss.item() == pytest.approx(want_weight * -0.775, abs=1e-12)


def test_policy_loss_equal_behaviour_is_no_correction():
    gen = torch.Generator().manual_seed(11)
    mask = prefix_mask([6, 3, 0, 1], 6)
    logps = torch.randn(4, 6, generator=gen, dtype=torch.float64) - 2
    old = logps + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    plain = ppo_policy_loss(logps, old, advantages, mask, 0.2)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        weights = truncated_importance_weights(old, old.clone(), mask.double(), mode=mode)
        same = ppo_policy_loss(logps, old, advantages, mask, 0.2, importance_weights=weights)
        assert same.loss.item() == pytest.approx(plain.loss.item(), abs=1e-12)


def test_policy_loss_against_loop():
    gen = torch.Generator().manual_seed(5)
    lengths, T, eps = [6, 3, 0, 1], 6, 0.2
    mask = prefix_mask(lengths, T)
    logps = torch.randn(4, T, generator=gen, dtype=torch.float64) - 2
    old = logps + 0.4 * torch.randn(4, T, generator=gen, dtype=torch.float64)
    advantages = torch.randn(4, T, generator=gen, dtype=torch.float64)
    got = ppo_policy_loss(logps, old, advantages, mask, eps, normalizer=20)
    total, clipped, n = 0.0, 0, 0
    for b, length in enumerate(lengths):
        for t in range(length):
            rho = math.exp(logps[b, t].item() - old[b, t].item())
            a = advantages[b, t].item()
            surrogate, clipped_surrogate = -a * rho, -a * min(max(rho, 1 - eps), 1 + eps)
            total += max(surrogate, clipped_surrogate)
            clipped += clipped_surrogate > surrogate
            n += 1
    assert got.loss.item() == pytest.approx(total / 20, abs=1e-12)  # the given normalizer, not N = 10
    assert got.clipfrac.item() == pytest.approx(clipped / n, abs=1e-12)


def test_all_empty_micro_batch_gives_zero_loss_and_gradient():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    logps = torch.randn(2, 3, requires_grad=True)
    values = torch.randn(2, 3, requires_grad=True)
    weights = truncated_importance_weights(torch.randn(2, 3), torch.randn(2, 3), mask.float())
    policy = ppo_policy_loss(logps, torch.randn(2, 3), torch.randn(2, 3), mask, 0.2, importance_weights=weights)
    value = value_loss(values, torch.randn(2, 3), torch.randn(2, 3), mask, 0.2)
    (policy.loss + value.loss).backward()
    assert policy.loss.item() == 0.0 and value.loss.item() == 0.0
    assert not logps.grad.any() and not values.grad.any()


def test_policy_loss_rejects_bad_arguments():
    logps, old, advantages, mask, _ = policy_example()
    with pytest.raises(ValueError, match="cliprange"):
        ppo_policy_loss(logps, old, advantages, mask, 0.0)
    with pytest.raises(ValueError, match="importance_weights"):
        ppo_policy_loss(logps, old, advantages, mask, 0.2, importance_weights=old[:, :2])
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(logps, old, advantages[:, :2], mask, 0.2)


# ------------------------------------------------------------------------------------ masked statistics


def test_masked_mean_and_var_match_numpy():
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 2, 0, 4]
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = prefix_mask(lengths, 5)
    x = fill_padding(x, mask, float("nan"))
    valid = np.concatenate([x[b, :n].numpy() for b, n in enumerate(lengths)])
    assert masked_mean(x, mask).item() == pytest.approx(valid.mean(), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(valid.var(ddof=1), abs=1e-12)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(valid.var(ddof=0), abs=1e-12)
    row_means = masked_mean(x, mask, dim=1).tolist()
    assert row_means == pytest.approx([x[b, :n].mean().item() if n else 0.0 for b, n in enumerate(lengths)])


def test_masked_statistics_of_empty_and_single_sets_are_zero():
    x = torch.tensor([[3.0, 4.0]])
    assert masked_mean(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_var(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_var(x, torch.tensor([[1, 0]])).item() == 0.0  # unbiased variance of one token: undefined -> 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_whiten_mean_zero_var_one_and_padding_untouched(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [6, 0, 3, 5, 1]
    mask = prefix_mask(lengths, 6)
    x = 3.0 + 2.0 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    x = fill_padding(x, mask, float("nan"))
    got = masked_whiten(x, mask)
    valid = got[mask].numpy()
    assert valid.mean() == pytest.approx(0.0, abs=1e-12)
    assert valid.var(ddof=1) == pytest.approx(1.0, abs=1e-6)  # unbiased, as TRL's masked_whiten (eps 1e-8)
    assert torch.equal(got[~mask].isnan(), x[~mask].isnan())  # padding returned as it came
    # Transcription of TRL's former formula on the valid entries: (x - mean) · rsqrt(var_unbiased + 1e-8).
    original = x[mask].numpy()
    want = (original - original.mean()) / np.sqrt(original.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(valid, want, rtol=1e-12, atol=1e-12)


def test_masked_whiten_without_mean_shift_keeps_the_mean():
    gen = torch.Generator().manual_seed(4)
    mask = prefix_mask([4, 2, 5], 5)
    x = 1.5 + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    got = masked_whiten(x, mask, shift_mean=False)
    original = x[mask].numpy()
    assert got[mask].numpy().mean() == pytest.approx(original.mean(), abs=1e-12)
    assert got[mask].numpy().var(ddof=1) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(got[~mask], x[~mask])


def test_masked_whiten_degenerate_sets():
    x = torch.tensor([[2.0, 5.0, 7.0]])
    assert torch.equal(masked_whiten(x, torch.zeros(1, 3)), x)  # nothing valid: nothing changes
    assert masked_whiten(x, torch.tensor([[1, 0, 0]])).tolist() == [[0.0, 5.0, 7.0]]  # one token: centred to 0
    assert masked_whiten(x, torch.tensor([[1, 0, 0]]), shift_mean=False).tolist() == [[2.0, 5.0, 7.0]]


# ------------------------------------------------------------------------------------ explained variance


def test_explained_variance_matches_cleanrl_formula():
    gen = torch.Generator().manual_seed(9)
    lengths = [5, 3, 0, 4]
    mask = prefix_mask(lengths, 5)
    returns = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    values = fill_padding(values, mask, float("inf"))
    y_true, y_pred = returns[mask].numpy(), values[mask].numpy()
    want = 1 - np.var(y_true - y_pred) / np.var(y_true)  # CleanRL's ppo.py
    assert explained_variance(values, returns, mask).item() == pytest.approx(want, abs=1e-12)


def test_explained_variance_edge_cases():
    returns = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # A perfect critic explains everything.
    assert explained_variance(returns.clone(), returns, mask).item() == 1.0
    # A constant critic explains nothing: Var[R - c] = Var[R].
    assert explained_variance(torch.full_like(returns, 5.0), returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    # Predicting -R (R = [1, 2, 4]: mean 7/3, Var[R] = 14/9; Var[2R] = 56/9) gives 1 - 4 = -3.
    assert explained_variance(-returns, returns, mask).item() == pytest.approx(-3.0, abs=1e-12)
    # Var[R] = 0 (all returns equal, a single valid token, or none): undefined -> NaN, as CleanRL.
    # (a varying critic on constant returns: without the guard this would be 1 - Var[R - V] / 0 = -inf)
    assert math.isnan(explained_variance(torch.tensor([[0.0, 1.0, 3.0, 0.0]]), torch.full((1, 4), 2.0), mask).item())
    assert math.isnan(explained_variance(torch.zeros(1, 4), returns, torch.tensor([[1, 0, 0, 0]])).item())
    assert math.isnan(explained_variance(torch.zeros(1, 4), returns, torch.zeros(1, 4)).item())


# ------------------------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_no_function_reads_tensor_data_on_the_host(mode):
    # Meta tensors hold no data: any .item(), bool(tensor) or data-dependent Python branch raises. Running every
    # function (and the backward pass) on them shows that none of them syncs a GPU with the host.
    B, T = 3, 5

    def empty():
        return torch.empty(B, T, device="meta")

    mask = torch.empty(B, T, dtype=torch.bool, device="meta")
    kl_shaped_rewards(torch.empty(B, device="meta"), empty(), empty(), mask, 0.05, kl_estimator="k3")
    gae(empty(), empty(), mask, 1.0, 0.95)
    masked_whiten(empty(), mask, shift_mean=False)
    explained_variance(empty(), empty(), mask)
    values, logps = empty().requires_grad_(True), empty().requires_grad_(True)
    critic = value_loss(values, empty(), empty(), mask, 0.2)
    weights = empty() if mode.startswith("token") else torch.empty(B, 1, device="meta")
    policy = ppo_policy_loss(logps, empty(), empty(), mask, 0.2, importance_weights=weights)
    (policy.loss + 0.1 * critic.loss).backward()
    assert logps.grad.shape == (B, T) and values.grad.shape == (B, T)
    with pytest.raises(RuntimeError):  # the premise: reading a meta tensor's data fails
        policy.loss.item()
