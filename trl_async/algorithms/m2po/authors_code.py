"""Rule ``"authors_code"``: what the authors' training code computes, and so what produced the paper's numbers.

Infini-AI-Lab/M2PO ``verl/trainer/ppo/core_algos.py`` (``kpo_clip_harmful_tokens`` /
``_solve_tau_from_sorted_delta2`` / ``compute_m2po_policy_loss``): over the harmful (trust-region) tokens it finds a
cut tau_c at which the mean of min(delta^2, tau_c^2) is <= tau_M2 and applies the PPO clip [exp(-tau_c), exp(tau_c)];
no clip when the budget already holds.  Optional floors (their ``miniclip_low`` / ``miniclip_high``, 0.3 / 0.5 in
the function signature) are off in every shipped script and off by default here.

Unlike Algorithm 1 (``reference.py``) nothing is masked outright: a clipped token's ratio is held at its bound, so it
adds A_t * bound to the objective without gradient (``loss.py``).  Where this reading departs from the authors' code
(a token exactly on the cut, their no-clip clamp, a zero budget): docs/m2po.md, "How each rule decides, exactly".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .selection import (
    M2POSelection,
    _at,
    _device_sums,
    _empty_selection,
    _exp_safe_max,
    _float32_ceil,
    _float32_floor,
    _nan_selection,
    _scalar,
    _Tokens,
)
from .stats import _stats_from_device, _stats_from_host

# The authors' code compares with these slacks (``1e-12`` in ``kpo_clip_harmful_tokens`` and
# ``_solve_tau_from_sorted_delta2``); "authors_code" keeps them so that it decides exactly as their code does.
_AUTHORS_EPS = 1e-12


def _select_authors(tok: _Tokens, tau, ratio_dtype, clip_floor_low, clip_floor_high, on_host: bool) -> M2POSelection:
    """Rule "authors_code" (see :func:`m2po_select`)."""
    valid = tok.valid
    device, shape = valid.device, valid.shape
    key = tok.r.square()  # harmful delta^2, 0 elsewhere
    dv_flat = tok.dv.reshape(-1)
    scalars = [
        valid.sum(),
        torch.count_nonzero(tok.r),
        key.sum(dtype=torch.float64),
        torch.dot(dv_flat, dv_flat),
        tok.delta.max(),
    ]
    if on_host:
        host = [x.item() for x in scalars]  # host memory: reads, no device sync
    else:
        host = torch.stack(scalars).tolist()  # the single host sync
    n_valid, n_harm, sum_harm, sum_valid = int(host[0]), int(host[1]), host[2], host[3]
    ratios_finite = bool(host[4] < _exp_safe_max(ratio_dtype))
    no_clip = {"clip_log_bound": _scalar(math.inf, device)}
    if n_valid == 0:
        return _empty_selection(shape, device, ratios_finite, no_clip)
    if math.isnan(sum_valid) or math.isnan(sum_harm):
        return _nan_selection(tok, n_valid, ratios_finite, no_clip)
    # kpo_clip_harmful_tokens: no harmful token, or the harmful tokens' mean delta^2 within the budget (+1e-12):
    # no clip ("effectively no constraint").
    if n_harm == 0 or sum_harm / n_harm <= tau + _AUTHORS_EPS:
        sums = [n_valid, n_valid, n_harm, n_harm, sum_valid, sum_valid, sum_harm, sum_harm, 0.0]
        stats = _stats_from_host(sums, device, no_clip)
        return M2POSelection(valid.clone(), stats, n_valid=n_valid, ratios_finite=ratios_finite)
    flat_trust = tok.trust.reshape(-1)
    if on_host:
        harm_idx = flat_trust.nonzero().squeeze(1)
    else:
        harm_idx = torch.nonzero_static(flat_trust, size=n_harm).squeeze(1)
    cut2 = _authors_cut(torch.sort(key.reshape(-1)[harm_idx]).values, tau)
    clipped, low, high = _authors_clipped(tok, cut2, clip_floor_low, clip_floor_high)
    keep = valid & ~clipped
    stats = _stats_from_device(_device_sums(tok, keep), {"clip_log_bound": cut2.sqrt().float()})
    return M2POSelection(keep, stats, clipped, low, high, n_valid=n_valid, ratios_finite=ratios_finite)


def _authors_cut(sorted_asc: Tensor, tau: float) -> Tensor:
    """The cut of ``_solve_tau_from_sorted_delta2`` (authors' ``core_algos.py``), as tau_c^2, on the device.

    v = harmful delta^2 ascending (n of them), target S = tau * n, csum_k = v_0 + ... + v_k.  Capping every value
    at a breakpoint v_k gives the sum csum_k + v_k * (n - k - 1); k* is the first k at which that (with their
    1e-12 slacks) reaches S, and the cut is the breakpoint before it, v_{k*-1} (0 when k* = 0).  So the cut is
    the largest breakpoint whose capped mean stays within tau (it is not interpolated).  The caller has checked
    that the budget is broken (mean v > tau + 1e-12), so k* exists.
    """
    n = sorted_asc.numel()
    v = sorted_asc.to(torch.float64)
    csum = v.cumsum(0)
    rest = torch.arange(n - 1, -1, -1, dtype=torch.float64, device=v.device)  # n - k - 1
    capped = csum + torch.where(rest > 0, (v - _AUTHORS_EPS) * rest, 0.0)  # no inf * 0 at the last (+inf) value
    cond = capped >= tau * n - _AUTHORS_EPS
    k_star = torch.argmax(cond.to(torch.uint8))
    return torch.where(k_star > 0, _at(v, (k_star - 1).clamp(min=0)), 0.0)


def _authors_clipped(tok: _Tokens, cut2: Tensor, clip_floor_low, clip_floor_high):
    """Tokens whose ratio the authors' PPO clip replaces by its bound, and the bounds in log space.

    Their bounds are [exp(-tau_c), exp(tau_c)] with tau_c = sqrt(cut - 1e-12) (so a token whose delta^2 equals the
    cut is outside), widened by the optional floors to [min(exp(-tau_c), 1 - floor_low), max(exp(tau_c),
    1 + floor_high)].  In PPO's min(r A, clip(r) A) only the harmful quadrants can bind, so the clipped tokens are
    the trust-region tokens with delta^2 >= cut (and beyond the floors).
    """
    delta = tok.delta
    key = tok.r.square()  # harmful delta^2, 0 elsewhere
    clipped = tok.trust & (key >= cut2.to(key.dtype))  # cut2 is one of the float32 delta^2 values: exact
    tau_c = cut2.clamp(min=0.0).sqrt()
    high, low = tau_c, -tau_c
    if clip_floor_high is not None:
        floor = math.log1p(clip_floor_high)
        clipped &= (delta <= 0) | (delta > _float32_floor(floor))
        high = high.clamp(min=floor)
    if clip_floor_low is not None:
        floor = math.log1p(-clip_floor_low)
        clipped &= (delta >= 0) | (delta < _float32_ceil(floor))
        low = low.clamp(max=floor)
    return clipped, low.float(), high.float()
