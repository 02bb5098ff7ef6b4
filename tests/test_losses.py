"""Tests for trl_async.losses (M2PO, arXiv:2510.01161, and the reference-page rule).

Every expectation is re-derived here in plain Python (brute force over k, hand-written gradients), never
taken from the code under test.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_async.losses import m2po_loss, m2po_mask, reference_m2po_loss

# --------------------------------------------------------------------------------------------------------
# Plain-Python references
# --------------------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    """Round a Python float to float32 (the precision delta and delta^2 are ranked in)."""
    if math.isinf(x) or math.isnan(x):
        return x
    return struct.unpack("<f", struct.pack("<f", x))[0]


def sq32(x: float) -> float:
    """float32(x)^2 rounded to float32 (the product of two float32 values is exact in a double)."""
    x = f32(x)
    return f32(x * x)


def brute_keep(deltas, valid, tau, droppable=None):
    """Brute force of the M2PO rule on flat lists.

    For k = 0, 1, ...: drop the k droppable tokens with the largest delta^2 (among equal delta^2 the lower
    index first), and stop at the first k for which the remaining valid tokens are non-empty with mean
    delta^2 <= tau.  If no k works, nothing is kept.
    """
    d2 = [sq32(x) for x in deltas]
    if droppable is None:
        droppable = valid
    cand = [i for i in range(len(d2)) if valid[i] and droppable[i]]
    order = sorted(cand, key=lambda i: (-d2[i], i))
    valid_idx = [i for i in range(len(d2)) if valid[i]]
    for k in range(len(order) + 1):
        dropped = set(order[:k])
        rest = [i for i in valid_idx if i not in dropped]
        if rest and sum(d2[i] for i in rest) / len(rest) <= tau:
            return [i in set(rest) for i in range(len(d2))]
    return [False] * len(d2)


def flat(t: torch.Tensor) -> list:
    return t.reshape(-1).tolist()


def lengths_mask(lengths, T):
    return [[t < n for t in range(T)] for n in lengths]


def check_against_brute(delta: torch.Tensor, mask: torch.Tensor, tau: float, **kw) -> list:
    got = m2po_mask(delta, mask, tau, **kw)
    assert got.dtype == torch.bool and got.shape == delta.shape
    droppable = None
    if kw.get("aligned_only"):
        adv = kw["advantages"]
        if adv.dim() == 1:
            adv = adv.unsqueeze(1)
        adv = adv.expand(delta.shape)
        droppable = [(a > 0 and d > 0) or (a < 0 and d < 0) for a, d in zip(flat(adv), flat(delta), strict=True)]
    expected = brute_keep(flat(delta), [bool(v) for v in flat(mask)], tau, droppable)
    assert flat(got) == expected
    return expected


# --------------------------------------------------------------------------------------------------------
# Random cases
# --------------------------------------------------------------------------------------------------------


def _heavy_tail(rng: random.Random, n: int, base: float, outlier_p: float, outlier_scale: float) -> list:
    out = []
    for _ in range(n):
        x = rng.gauss(0.0, base)
        if rng.random() < outlier_p:
            x = rng.choice([-1.0, 1.0]) * abs(rng.gauss(0.0, outlier_scale))
        out.append(x)
    return out


def _random_case(rng: random.Random, kind: str):
    B = rng.randint(1, 5)
    T = rng.randint(1, 48)
    lengths = [rng.randint(0, T) for _ in range(B)]
    tau = rng.choice([0.04, 0.01, 0.1, 0.2])
    if kind == "small":  # nothing masked (usually)
        vals = [rng.gauss(0, 0.05) for _ in range(B * T)]
    elif kind == "mixed":
        vals = _heavy_tail(rng, B * T, rng.choice([0.05, 0.15, 0.25]), 0.1, 1.0)
    elif kind == "ties":  # few distinct values -> many equal delta^2, including +-x pairs
        grid = [0.0, 0.1, -0.1, 0.25, -0.25, 0.5, -0.5, 1.0]
        vals = [rng.choice(grid) for _ in range(B * T)]
    elif kind == "zeros":
        vals = [0.0] * (B * T)
    elif kind == "big":  # every valid delta^2 above the threshold -> nothing kept
        vals = [rng.choice([-1, 1]) * rng.uniform(0.5, 2.0) for _ in range(B * T)]
    else:
        raise AssertionError(kind)
    delta = torch.tensor(vals, dtype=torch.float32).reshape(B, T)
    mask = torch.tensor(lengths_mask(lengths, T))
    return delta, mask, tau


@pytest.mark.parametrize("kind", ["small", "mixed", "ties", "zeros", "big"])
def test_mask_matches_brute_force_random(kind):
    rng = random.Random(["small", "mixed", "ties", "zeros", "big"].index(kind))
    n_cases = 80 if kind in ("mixed", "ties") else 30
    n_dropped_somewhere = 0
    for _ in range(n_cases):
        delta, mask, tau = _random_case(rng, kind)
        expected = check_against_brute(delta, mask, tau)
        n_dropped_somewhere += sum(bool(v) for v in flat(mask)) != sum(expected)
        # Float 0/1 masks behave like bool masks.
        assert flat(m2po_mask(delta, mask.float(), tau)) == expected
    if kind in ("mixed", "ties", "big"):
        assert n_dropped_somewhere > 0  # the cases really exercise dropping


def test_mask_edge_cases():
    tau = 0.04
    # A single valid token, below / above the threshold.
    assert flat(m2po_mask(torch.tensor([[0.1, 5.0]]), torch.tensor([[1, 0]]), tau)) == [True, False]
    assert flat(m2po_mask(torch.tensor([[0.3, 0.0]]), torch.tensor([[1, 0]]), tau)) == [False, False]
    # No valid token at all.
    assert flat(m2po_mask(torch.zeros(2, 3), torch.zeros(2, 3), tau)) == [False] * 6
    # Empty tensor.
    assert m2po_mask(torch.zeros(0, 4), torch.zeros(0, 4), tau).shape == (0, 4)
    # Mean exactly at the threshold is kept (<=, not <): 0.25^2 = 0.0625 is exact in binary.
    assert flat(m2po_mask(torch.full((1, 4), 0.25), torch.ones(1, 4), 0.0625)) == [True] * 4
    # Ties: four equal delta^2 (+-0.5) and the bound needs two of them dropped -> the two lowest indices go.
    # d2 = [0.25]*4 + [0]*4: dropping 2 gives 0.5/6 = 0.0833 <= 0.1, dropping 1 gives 0.75/7 = 0.107 > 0.1.
    d = torch.tensor([[0.0, 0.5, 0.0, -0.5, 0.0, 0.5, 0.0, -0.5]])
    assert flat(m2po_mask(d, torch.ones_like(d), 0.1)) == [True, False, True, False, True, True, True, True]
    # Padding never kept, never counted: huge padded values don't influence the valid tokens.
    d = torch.tensor([[0.1, 0.1, 50.0, 50.0]])
    assert flat(m2po_mask(d, torch.tensor([[1, 1, 0, 0]]), tau)) == [True, True, False, False]
    # Dropped tokens all have delta^2 > tau, and +inf is dropped first (no NaN from inf - inf).
    d = torch.tensor([[float("inf"), 0.1, 0.1, 0.1, 0.5]])
    check_against_brute(d, torch.ones_like(d), tau)
    assert flat(m2po_mask(d, torch.ones_like(d), tau)) == [False, True, True, True, False]
    # NaN on a valid token: the bound cannot be verified -> nothing kept.
    d = torch.tensor([[float("nan"), 0.1, 0.1]])
    assert flat(m2po_mask(d, torch.ones_like(d), tau)) == [False, False, False]
    # NaN on padding is ignored.
    assert flat(m2po_mask(d, torch.tensor([[0, 1, 1]]), tau)) == [False, True, True]


def test_mask_rejects_bad_threshold():
    with pytest.raises(ValueError):
        m2po_mask(torch.zeros(2, 2), torch.ones(2, 2), -0.1)


def _next_f32(x: float, up: bool) -> float:
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<i", bits + (1 if up else -1)))[0]


def test_mask_threshold_between_float32_values(monkeypatch):
    # tau sits just below a float32 value X (0.4 ulp below), so float32(tau) rounds UP to X.  A token with
    # delta^2 == X is above tau and may be dropped; comparing in float32 against float32(tau) would wrongly
    # make it undroppable.  Tokens: (m + 1) copies of X and one Y < tau, with m chosen so that all of them
    # break the bound but dropping one X meets it (margins are ~0.1 float32 ulp, far above float64 noise).
    x = f32(0.316)
    X = sq32(x)
    s = _next_f32(X, up=True) - X
    tau = X - 0.4 * s
    assert f32(tau) == X
    y = _next_f32(x, up=False)
    Y = sq32(y)
    a, c = X - tau, tau - Y
    m = math.floor(c / a)
    assert m * a < c - 0.1 * s and c + 0.1 * s < (m + 1) * a
    d = torch.tensor([[x] * (m + 1) + [y]])
    expected = check_against_brute(d, torch.ones_like(d), tau)
    assert expected == [False] + [True] * (m + 1)
    # The same blocks, 64 of them: about half of the X tokens must go, far more than the top-k window (16),
    # so the general path decides (its candidate test runs on the device in float32).
    spy = _SortSpy(monkeypatch)
    d = torch.tensor([[x] * (m + 1) + [y]] * 64)
    expected = check_against_brute(d, torch.ones_like(d), tau)
    assert 20 <= expected.count(False) <= 40 and spy.general == 1


# --------------------------------------------------------------------------------------------------------
# Fast paths: each is hit, and gives the brute-force answer
# --------------------------------------------------------------------------------------------------------


class _SortSpy:
    """Counts top-k calls and entries into the general path (the only place that compacts the candidates
    with ``nonzero``, before its one sort)."""

    def __init__(self, monkeypatch):
        self.general = 0
        self.topks = 0
        real_nonzero, real_nonzero_static, real_topk = torch.Tensor.nonzero, torch.nonzero_static, torch.topk

        def nonzero(t, *a, **k):
            self.general += 1
            return real_nonzero(t, *a, **k)

        def nonzero_static(t, *a, **k):
            self.general += 1
            return real_nonzero_static(t, *a, **k)

        def topk(t, *a, **k):
            self.topks += 1
            return real_topk(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, "nonzero", nonzero)
        monkeypatch.setattr(torch, "nonzero_static", nonzero_static)
        monkeypatch.setattr(torch, "topk", topk)


def _mixture(seed: int, B: int, T: int, outlier_p: float, base: float):
    rng = random.Random(seed)
    lengths = [rng.randint(T // 4, T) for _ in range(B)]
    vals = _heavy_tail(rng, B * T, base, outlier_p, 1.5)
    return torch.tensor(vals).reshape(B, T), torch.tensor(lengths_mask(lengths, T))


def _regime_case(seed: int, B: int, T: int, regime: str):
    """Log ratios whose M2PO answer drops about nothing / 1% / 20% / everything of the valid tokens."""
    rng = random.Random(seed)
    lengths = [rng.randint(T // 4, T) for _ in range(B)]

    def draw():
        sign = rng.choice([-1.0, 1.0])
        if regime == "none":
            return rng.gauss(0.0, 0.1)
        if regime == "1pct":  # mean delta^2 ~0.03 + ~1.2% outliers with delta^2 ~4
            return sign * rng.uniform(1.5, 2.5) if rng.random() < 0.012 else rng.gauss(0.0, 0.18)
        if regime == "20pct":
            return sign * rng.uniform(0.5, 1.5) if rng.random() < 0.25 else rng.gauss(0.0, 0.15)
        if regime == "all":  # every |delta| > 0.3 > sqrt(0.04)
            return sign * rng.uniform(0.3, 1.5)
        raise AssertionError(regime)

    vals = [draw() for _ in range(B * T)]
    return torch.tensor(vals).reshape(B, T), torch.tensor(lengths_mask(lengths, T))


@pytest.mark.parametrize(
    ("regime", "expect_sort", "frac_range"),
    [
        ("none", False, (0.0, 0.0)),
        ("1pct", False, (0.003, 0.02)),
        ("20pct", True, (0.12, 0.3)),
        ("all", True, (1.0, 1.0)),
    ],
)
def test_fast_paths_are_hit_and_exact(monkeypatch, regime, expect_sort, frac_range):
    spy = _SortSpy(monkeypatch)
    for seed in range(4):
        delta, mask = _regime_case(seed, 8, 256, regime)
        before = spy.general
        expected = check_against_brute(delta, mask, 0.04)
        frac = 1.0 - sum(expected) / int(mask.sum())
        assert frac_range[0] <= frac <= frac_range[1], frac
        assert (spy.general > before) == expect_sort
    assert spy.topks > 0


def test_topk_path_with_ties_at_the_cut(monkeypatch):
    # 2048 tokens, k0 = 16: five tokens share delta^2 = 1 and only some of them must go; the lowest flat
    # indices among the tied ones are dropped, decided inside the top-k (no full sort).
    spy = _SortSpy(monkeypatch)
    delta = torch.zeros(8, 256)
    tied = [(0, 200), (2, 5), (3, 100), (5, 7), (7, 255)]
    for r, c in tied:
        delta[r, c] = -1.0 if c % 2 else 1.0
    mask = torch.ones(8, 256, dtype=torch.bool)
    # mean with j of the five kept = j/2048 -> need j/2048 <= tau; tau = 2.5/2048 -> keep 2, drop 3.
    tau = 2.5 / 2048
    expected = check_against_brute(delta, mask, tau)
    assert spy.general == 0
    kept_tied = [(r, c) for r, c in tied if expected[r * 256 + c]]
    assert kept_tied == [(5, 7), (7, 255)]


@pytest.mark.parametrize(("n_big", "expect_sort"), [(0, False), (10, False), (40, True)])
def test_mean_exactly_at_threshold_is_kept_in_every_path(monkeypatch, n_big, expect_sort):
    # 2048 tokens (top-k window k0 = 16): n_big tokens with delta^2 = 1, then R = 2048 - n_big tokens of which
    # R/2 have delta^2 = 1/16 and the rest 0.  With tau = 1/32, dropping exactly the big ones leaves a mean
    # of exactly tau (all dyadic: exact in float32/float64), which satisfies "<= tau": k* = n_big.  With
    # n_big = 0 this is fast path (a); 10 is inside the top-k window; 40 is beyond it (general path).
    spy = _SortSpy(monkeypatch)
    rng = random.Random(n_big)
    N = 2048
    vals = [1.0] * n_big + [0.25] * ((N - n_big) // 2) + [0.0] * ((N - n_big) // 2)
    rng.shuffle(vals)
    delta = torch.tensor(vals).reshape(8, 256)
    expected = check_against_brute(delta, torch.ones(8, 256), 1 / 32)
    assert sum(expected) == N - n_big
    assert (spy.general > 0) == expect_sort


@pytest.mark.parametrize("seed", range(30))
def test_mask_matches_brute_force_larger(seed):
    # Bigger tensors mixing regimes, so the random search reaches well past the top-k window too.
    rng = random.Random(1000 + seed)
    B, T = rng.randint(2, 6), rng.randint(64, 200)
    p = rng.choice([0.0, 0.005, 0.02, 0.1, 0.4])
    delta, mask = _mixture(seed, B, T, p, rng.choice([0.05, 0.15, 0.2]))
    if seed % 3 == 0:
        delta = torch.round(delta * 4) / 4  # coarse grid -> heavy ties
    check_against_brute(delta, mask, rng.choice([0.04, 0.02]))


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("regime", ["none", "1pct", "20pct", "all"])
def test_accelerator_branch_matches_brute_force(monkeypatch, regime, aligned):
    # On an accelerator the candidate count comes with the single sync and nonzero_static compacts the
    # candidates; run that branch on CPU so it is tested without a GPU.
    import trl_async.losses as losses_module

    monkeypatch.setattr(losses_module, "_host_tensors", lambda device: False)
    spy = _SortSpy(monkeypatch)
    for seed in range(3):
        delta, mask = _regime_case(50 + seed, 4, 200, regime)
        kw = {"advantages": torch.randn(4, generator=torch.Generator().manual_seed(seed)), "aligned_only": True}
        check_against_brute(delta, mask, 0.04, **(kw if aligned else {}))
    if regime in ("20pct", "all"):
        assert spy.general > 0


# --------------------------------------------------------------------------------------------------------
# aligned_only variant
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_aligned_only_matches_brute_force(seed):
    rng = random.Random(5000 + seed)
    B, T = rng.randint(1, 4), rng.randint(1, 64)
    vals = _heavy_tail(rng, B * T, rng.choice([0.05, 0.2]), 0.15, 1.0)
    if seed % 4 == 0:
        vals = [round(v * 4) / 4 for v in vals]
    delta = torch.tensor(vals).reshape(B, T)
    mask = torch.tensor(lengths_mask([rng.randint(0, T) for _ in range(B)], T))
    if seed % 2:
        adv = torch.tensor([rng.choice([-1.0, 0.0, 1.0]) * rng.random() for _ in range(B)])
    else:
        adv = torch.tensor([rng.gauss(0, 1) for _ in range(B * T)]).reshape(B, T)
    check_against_brute(delta, mask, 0.04, advantages=adv, aligned_only=True)


def test_aligned_only_keeps_non_aligned_tokens():
    # A > 0: a token with r < 1 (delta < 0) is never dropped, however large its delta^2.
    delta = torch.tensor([[-0.6, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0])
    keep = m2po_mask(delta, torch.ones_like(delta), 0.05, advantages=adv, aligned_only=True)
    # All: 0.72/10 = 0.072 > 0.05.  Dropping the aligned 0.6 leaves 0.36/9 = 0.04 <= 0.05.
    assert flat(keep) == [True, False] + [True] * 8
    # Without the variant the first (lower index) of the two equal delta^2 goes.
    assert flat(m2po_mask(delta, torch.ones_like(delta), 0.05)) == [False, True] + [True] * 8
    # If the non-droppable tokens alone break the bound, nothing is kept.
    delta = torch.tensor([[-0.9, 0.6, 0.0, 0.0]])
    keep = m2po_mask(delta, torch.ones_like(delta), 0.04, advantages=adv, aligned_only=True)
    assert flat(keep) == [False] * 4
    with pytest.raises(ValueError):
        m2po_mask(delta, torch.ones_like(delta), 0.04, aligned_only=True)


# --------------------------------------------------------------------------------------------------------
# Hypothesis properties
# --------------------------------------------------------------------------------------------------------

_deltas = st.lists(st.floats(-2.0, 2.0, allow_nan=False, width=32), min_size=1, max_size=60)


@st.composite
def _cases(draw):
    d = draw(_deltas)
    valid = draw(st.lists(st.booleans(), min_size=len(d), max_size=len(d)))
    tau = draw(st.sampled_from([0.0, 0.01, 0.04, 0.1, 0.5]) | st.floats(0.0, 1.0))
    return d, valid, tau


_PROP = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@_PROP
@given(_cases())
def test_property_bound_and_minimality(case):
    d, valid, tau = case
    keep = flat(m2po_mask(torch.tensor([d]), torch.tensor([valid]), tau))
    d2 = [sq32(x) for x in d]
    n = sum(valid)
    assert all(v for k, v in zip(keep, valid, strict=True) if k)  # padding never kept
    kept = [d2[i] for i in range(len(d)) if keep[i]]
    valid_d2 = sorted((d2[i] for i in range(len(d)) if valid[i]), reverse=True)
    tol = 1e-12 * max(tau, 1e-300)
    if kept:
        assert math.fsum(kept) / len(kept) <= tau + tol
        k = n - len(kept)
        # The dropped ones are exactly a set of largest values (as a multiset).
        dropped = sorted((d2[i] for i in range(len(d)) if valid[i] and not keep[i]), reverse=True)
        assert dropped == valid_d2[:k]
    else:
        k = n
    # No smaller number of dropped largest values meets the bound.
    for j in range(k):
        rest = valid_d2[j:]
        if rest:
            assert math.fsum(rest) / len(rest) > tau - tol


@_PROP
@given(_cases(), st.randoms(use_true_random=False))
def test_property_permutation_equivariant(case, rnd):
    d, valid, tau = case
    perm = list(range(len(d)))
    rnd.shuffle(perm)
    keep = flat(m2po_mask(torch.tensor(d), torch.tensor(valid), tau))
    d_p = [d[i] for i in perm]
    v_p = [valid[i] for i in perm]
    keep_p = flat(m2po_mask(torch.tensor(d_p), torch.tensor(v_p), tau))

    def dropped_multiset(dd, vv, kk):
        return sorted(sq32(x) for x, v, k in zip(dd, vv, kk, strict=True) if v and not k)

    assert sum(keep) == sum(keep_p)
    assert dropped_multiset(d, valid, keep) == dropped_multiset(d_p, v_p, keep_p)
    # Without ties the mask itself is permuted.
    if len({sq32(x) for x, v in zip(d, valid, strict=True) if v}) == sum(valid):
        assert keep_p == [keep[i] for i in perm]


# --------------------------------------------------------------------------------------------------------
# m2po_loss
# --------------------------------------------------------------------------------------------------------


def _stale_batch(seed: int, B: int = 6, T: int = 40, adv_2d: bool = False):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(B, T, generator=g) * 3
    noise = torch.randn(B, T, generator=g) * 0.15
    outliers = (torch.rand(B, T, generator=g) < 0.15) * torch.randn(B, T, generator=g) * 1.2
    logp = (behaviour + noise + outliers).requires_grad_()
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, T, generator=g) if adv_2d else torch.randn(B, generator=g)
    return logp, behaviour, adv, mask


@pytest.mark.parametrize("adv_2d", [False, True])
@pytest.mark.parametrize("use_normalizer", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_m2po_gradient_matches_formula(seed, adv_2d, use_normalizer):
    logp, behaviour, adv, mask = _stale_batch(seed, adv_2d=adv_2d)
    B, T = logp.shape
    normalizer = torch.tensor(37.5) if use_normalizer else None
    loss, stats = m2po_loss(logp, behaviour, adv, mask, 0.04, normalizer=normalizer)
    loss.backward()

    delta = flat(logp.detach() - behaviour)
    valid = [bool(v) for v in flat(mask)]
    keep = brute_keep(delta, valid, 0.04)
    n_valid = sum(valid)
    N = 37.5 if use_normalizer else max(n_valid, 1)
    a = flat(adv) if adv_2d else [x for x in flat(adv) for _ in range(T)]
    expected_grad = [-(k * math.exp(d) * ai) / N for k, d, ai in zip(keep, delta, a, strict=True)]
    expected_loss = -sum(k * math.exp(d) * ai for k, d, ai in zip(keep, delta, a, strict=True)) / N
    torch.testing.assert_close(logp.grad.reshape(-1), torch.tensor(expected_grad), rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    # Stats against the same re-derivation.
    d2 = [sq32(x) for x in delta]
    kept = sum(keep)
    assert 0 < kept < n_valid  # the batch is stale enough to mask something
    assert stats["masked_fraction"].item() == pytest.approx((n_valid - kept) / n_valid, rel=1e-6)
    assert stats["m2_before"].item() == pytest.approx(
        sum(x for x, v in zip(d2, valid, strict=True) if v) / n_valid, rel=1e-5
    )
    assert stats["m2_after"].item() == pytest.approx(
        sum(x for x, k in zip(d2, keep, strict=True) if k) / kept, rel=1e-5
    )
    assert stats["m2_after"].item() <= 0.04 * (1 + 1e-6)
    assert not stats["all_masked"].item()
    assert all(not v.requires_grad for v in stats.values())


def test_m2po_stats_in_every_path():
    # nothing masked / top-k path / general path: stats agree with a plain re-derivation.
    for regime in ("none", "1pct", "20pct"):
        delta, mask = _regime_case(7, 8, 256, regime)
        logp = delta.clone().requires_grad_()
        _, stats = m2po_loss(logp, torch.zeros_like(delta), torch.ones(8), mask)
        valid = [bool(v) for v in flat(mask)]
        keep = brute_keep(flat(delta), valid, 0.04)
        d2 = [sq32(x) for x in flat(delta)]
        n, kept = sum(valid), sum(keep)
        assert stats["masked_fraction"].item() == pytest.approx(1 - kept / n, abs=1e-7)
        assert stats["m2_before"].item() == pytest.approx(
            sum(x for x, v in zip(d2, valid, strict=True) if v) / n, rel=1e-5
        )
        assert stats["m2_after"].item() == pytest.approx(
            sum(x for x, k in zip(d2, keep, strict=True) if k) / kept, rel=1e-5
        )


def test_m2po_all_kept_equals_mean_ratio_times_advantage():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 30
    behaviour = -torch.rand(B, T, generator=g) * 2
    logp = (behaviour + torch.randn(B, T, generator=g) * 0.02).requires_grad_()
    mask = torch.arange(T)[None] < torch.tensor([30, 1, 17, 0, 9])[:, None]
    adv = torch.randn(B, generator=g)
    loss, stats = m2po_loss(logp, behaviour, adv, mask)
    assert stats["masked_fraction"].item() == 0.0
    terms = [
        math.exp(lp - b) * adv[i].item()
        for i in range(B)
        for t, (lp, b) in enumerate(zip(logp[i].tolist(), behaviour[i].tolist(), strict=True))
        if mask[i, t]
    ]
    assert loss.item() == pytest.approx(-math.fsum(terms) / len(terms), rel=1e-6)
    # No clip: a ratio of 1.3 with A > 0 still has gradient (GRPO's clip would zero it at eps = 0.2).
    lp2 = torch.tensor([[math.log(1.3), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    loss2, st2 = m2po_loss(lp2, torch.zeros(1, 10), torch.tensor([1.0]), torch.ones(1, 10), threshold=0.04)
    loss2.backward()
    assert st2["masked_fraction"].item() == 0.0  # log(1.3)^2 / 10 = 0.0069 <= 0.04
    assert lp2.grad[0, 0].item() == pytest.approx(-1.3 / 10, rel=1e-6)


def test_m2po_all_masked_is_a_zero_loss_with_a_graph():
    logp = torch.tensor([[0.0, -5.0, -0.2], [-3.0, 0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0, -1.0], [float("-inf"), -1.0, -1.0]])  # one ratio is +inf
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = m2po_loss(logp, behaviour, torch.tensor([1.0, -2.0]), mask)
    assert loss.item() == 0.0 and loss.requires_grad and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert stats["all_masked"].item() is True
    assert stats["masked_fraction"].item() == 1.0
    assert stats["m2_after"].item() == 0.0
    assert all(not torch.isnan(v).any() for v in stats.values())


def test_m2po_no_valid_tokens_and_normalizer_guard():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = m2po_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(logp.grad).any()
    assert stats["all_masked"].item() is False and stats["masked_fraction"].item() == 0.0
    # A zero tensor normaliser is not divided by.
    loss, _ = m2po_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), normalizer=torch.tensor(0.0))
    assert loss.item() == 0.0
    with pytest.raises(ValueError):
        m2po_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), normalizer=0)


def test_m2po_dropped_overflowing_ratio_gives_finite_gradients():
    # delta = 100 overflows exp in float32; the token is dropped and must not poison the gradient.
    logp = torch.tensor([[100.0] + [0.0] * 99], requires_grad=True)
    loss, stats = m2po_loss(logp, torch.zeros(1, 100), torch.tensor([1.0]), torch.ones(1, 100))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-1 / 100)
    assert stats["masked_fraction"].item() == pytest.approx(0.01)


@pytest.mark.parametrize("pad_value", [float("nan"), float("inf"), 1e4])
def test_m2po_non_finite_padding_is_ignored(pad_value):
    # Padding may hold anything (NaN / inf / overflowing log-probs): it changes neither value nor gradient.
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(3, 12, generator=g) * 0.1).requires_grad_()
    mask = torch.arange(12)[None] < torch.tensor([12, 5, 8])[:, None]
    behaviour = torch.where(mask, torch.zeros(3, 12), torch.full((3, 12), -pad_value))
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = m2po_loss(logp, behaviour, adv, mask)
    loss.backward()
    d = logp.detach()
    n = int(mask.sum())
    expected = -sum(math.exp(d[i, t]) * adv[i].item() for i in range(3) for t in range(12) if mask[i, t]) / n
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()
    assert stats["masked_fraction"].item() == 0.0


# --------------------------------------------------------------------------------------------------------
# reference_m2po_loss
# --------------------------------------------------------------------------------------------------------


def _reference_by_hand(logp, behaviour, adv, mask, gamma, el, eh):
    B, T = len(logp), len(logp[0])
    num, kept, valid_n, d2_valid, d2_kept = 0.0, 0, 0, 0.0, 0.0
    grads = [[0.0] * T for _ in range(B)]
    terms = []
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            d = f32(logp[i][t] - behaviour[i][t])
            valid_n += 1
            d2_valid += sq32(d)
            r = math.exp(d)
            if not r * r <= gamma:
                continue
            kept += 1
            d2_kept += sq32(d)
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
    stats = {
        "masked_fraction": (valid_n - kept) / max(valid_n, 1),
        "m2_before": d2_valid / max(valid_n, 1),
        "m2_after": d2_kept / max(kept, 1),
        "all_masked": kept == 0 and valid_n > 0,
    }
    return -num / denom, grads, stats


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
    loss, stats = reference_m2po_loss(logp, behaviour, adv, mask, gamma=2.0, epsilon_low=0.2, epsilon_high=0.28)
    loss.backward()
    adv2 = [[adv[i].item()] * T for i in range(B)]
    exp_loss, exp_grad, exp_stats = _reference_by_hand(
        logp.detach().tolist(), behaviour.tolist(), adv2, mask.tolist(), 2.0, 0.2, 0.28
    )
    assert loss.item() == pytest.approx(exp_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logp.grad, torch.tensor(exp_grad), rtol=1e-5, atol=1e-7)
    for k in ("masked_fraction", "m2_before", "m2_after"):
        assert stats[k].item() == pytest.approx(exp_stats[k], rel=1e-5, abs=1e-7), k
    assert stats["all_masked"].item() == exp_stats["all_masked"]
    # The case really exercises the masking and both clip sides.
    assert 0 < exp_stats["masked_fraction"] < 1
    d = (logp.detach() - behaviour)[mask]
    assert (d.exp() > 1.28).any() and (d.exp() < 0.8).any()


def test_reference_rule_padding_and_all_masked():
    # Padding is never kept even when its ratio is perfect; all valid tokens with r^2 > gamma -> zero loss.
    logp = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    loss, stats = reference_m2po_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
    loss.backward()
    assert loss.item() == 0.0 and stats["all_masked"].item() is True
    assert stats["masked_fraction"].item() == 1.0 and torch.equal(logp.grad, torch.zeros(1, 3))


# --------------------------------------------------------------------------------------------------------
# Host syncs
# --------------------------------------------------------------------------------------------------------


class _SyncCounter:
    """Counts the Python-level ways to read a tensor on the host (each is a device sync on an accelerator)."""

    NAMES = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__", "__iter__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def wrapper(self_t, *a, _real=real, _name=name, **k):
                if _name != "__len__" or self_t.dim() == 0:  # len() of a sized tensor reads no data
                    self.count += 1
                return _real(self_t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


def test_sync_counter_sees_syncs(monkeypatch):
    counter = _SyncCounter(monkeypatch)
    t = torch.ones(3)
    t.sum().item()
    bool(t[0])
    float(t[1])
    t.tolist()
    assert counter.count == 4


@pytest.mark.parametrize(
    "regime", ["nothing", "topk", "topk_ties", "general", "all_masked", "no_valid", "aligned", "empty", "nan"]
)
def test_at_most_one_host_sync_per_call(monkeypatch, regime):
    if regime in ("nothing", "topk", "general", "all_masked", "aligned", "nan"):
        kind = {
            "nothing": "none",
            "topk": "1pct",
            "general": "20pct",
            "all_masked": "all",
            "aligned": "20pct",
            "nan": "none",
        }[regime]
        delta, mask = _regime_case(3, 8, 256, kind)
        if regime == "nan":
            delta[0, 0] = float("nan")
    elif regime == "topk_ties":
        delta = torch.zeros(8, 256)
        delta[0, 3] = delta[1, 3] = delta[2, 3] = 1.0
        mask = torch.ones(8, 256)
    elif regime == "no_valid":
        delta, mask = torch.randn(4, 16), torch.zeros(4, 16)
    else:
        delta, mask = torch.zeros(0, 5), torch.zeros(0, 5)
    tau = 1.5 / 2048 if regime == "topk_ties" else 0.04
    kw = {"advantages": torch.randn(delta.shape[0]), "aligned_only": True} if regime == "aligned" else {}
    logp = delta.clone().requires_grad_()
    adv = torch.randn(delta.shape[0])
    counter = _SyncCounter(monkeypatch)
    keep = m2po_mask(delta, mask, tau, **kw)
    assert counter.count <= 1
    counter.count = 0
    loss, stats = m2po_loss(logp, torch.zeros_like(delta), adv, mask, tau, aligned_only=regime == "aligned")
    loss.backward()
    assert counter.count <= 1
    monkeypatch.undo()  # stop counting before reading results
    if regime == "topk_ties":
        assert flat(keep).count(False) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("regime", ["none", "1pct", "20pct", "all"])
def test_cuda_at_most_one_synchronizing_op(regime):
    import warnings

    delta, mask = _regime_case(11, 8, 256, regime)
    delta, mask = delta.cuda(), mask.cuda()
    logp = delta.clone().requires_grad_()
    behaviour, adv = torch.zeros_like(delta), torch.randn(8, device="cuda")
    m2po_loss(logp, behaviour, adv, mask)  # warm-up (lazy CUDA init may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            keep = m2po_mask(delta, mask, 0.04)
            n_mask = len(caught)
            loss, _ = m2po_loss(logp, behaviour, adv, mask)
            loss.backward()
            n_loss = len(caught) - n_mask
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert n_mask <= 1 and n_loss <= 1
    assert flat(keep.cpu()) == brute_keep(flat(delta.cpu()), [bool(v) for v in flat(mask.cpu())], 0.04)
