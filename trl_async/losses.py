"""Policy-gradient losses for asynchronous (stale) rollouts.

Pure tensor functions: no trainer state, nothing imported from the rest of ``trl_async``.

M2PO -- Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far
Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).  With behaviour policy mu (the policy
that sampled the tokens) and current policy pi_theta, per valid completion token t::

    delta_t = log pi_theta(y_t | .) - log mu(y_t | .)          (log importance ratio)
    r_t     = exp(delta_t)

M2PO bounds the *second moment* of the log ratio over the tokens that enter the update::

    M2 = mean_{t kept} delta_t^2  <=  tau_M2      (tau_M2 = 0.04 in the paper)

by masking out the *fewest* tokens with the largest delta_t^2 that make the bound hold (computed on the
detached delta), and then optimises the unclipped importance-weighted objective::

    J(theta) = (1 / N) * sum_t M_t * r_t * A_t,     loss = -J,

where N is the number of valid tokens *before* masking (the same normaliser TRL's ``dapo`` uses), so the
gradient is  d loss / d log pi_t = -M_t * r_t * A_t / N.  There is no epsilon-clip.

``reference_m2po_loss`` keeps, under a clearly different name, the per-token rule printed by a public
reference page (m_t = 1[r_t^2 <= gamma] inside the PPO clip), so its numbers can be reproduced side by
side with the paper's rule.  It is *not* the published M2PO.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from torch import Tensor

__all__ = ["m2po_mask", "m2po_loss", "reference_m2po_loss"]

# Fast path (b) looks at the top-k0 largest delta^2 first, with k0 = max(_TOPK_MIN, ceil(numel * _TOPK_FRACTION))
# (capped at numel).  k0 is derived from numel because the number of valid tokens is only known after the
# host sync.  With ~50% padding this covers ~1.6% of the valid tokens, enough for the "slightly stale" regime.
_TOPK_FRACTION = 1.0 / 128.0
_TOPK_MIN = 16
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _topk_size(numel: int) -> int:
    return min(numel, max(_TOPK_MIN, math.ceil(numel * _TOPK_FRACTION)))


def _float32_floor(x: float) -> float:
    """Largest float32 value <= x.  For a float32 y:  y > x  <=>  y > _float32_floor(x), so comparing a
    float32 tensor against it (torch compares in the tensor's dtype) is exact for the real threshold x."""
    if x >= _FLOAT32_MAX:
        return x if math.isinf(x) else _FLOAT32_MAX
    f = struct.unpack("<f", struct.pack("<f", x))[0]  # round to nearest float32
    if f > x:  # rounded up: step down one float32 ulp
        bits = struct.unpack("<i", struct.pack("<f", f))[0]
        bits = bits - 1 if f > 0 else bits + 1
        f = struct.unpack("<f", struct.pack("<i", bits))[0]
    return f


def _host_tensors(device: torch.device) -> bool:
    """True when tensors on ``device`` live in host memory: reading them is free and ``nonzero`` needs no
    sync.  Otherwise the candidate count travels with the single sync and ``nonzero_static`` is used.
    (A function so that tests can run the accelerator branch on CPU.)"""
    return device.type == "cpu"


def _scalar(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    # torch.full launches a fill with a host scalar: no device->host sync (unlike reading a tensor) and no
    # pageable host->device copy (unlike torch.tensor(value, device=...)).
    return torch.full((), value, dtype=dtype, device=device)


def _rank_desc_then_index(values: Tensor, flat_index: Tensor) -> Tensor:
    """Permutation ordering ``values`` (float32, >= 0 or +inf) by value descending, then flat index ascending.

    One sort of unique int64 keys: for float32 values >= 0 the bit pattern is monotone in the value (+inf
    included), so high word = 2^31 - 1 - bits, low word = flat index (< 2^32).  Unique keys make the order
    fully determined without a stable sort, and integer sorts are radix sorts (much faster on CPU).
    """
    bits = values.view(torch.int32).to(torch.int64)
    return torch.sort(((2**31 - 1 - bits) << 32) | flat_index).indices


def _exp_safe_d2(dtype: torch.dtype) -> float:
    """delta^2 below this bound means exp(delta) cannot overflow in ``dtype`` (float32/bf16: |delta| < 87.7)."""
    if not dtype.is_floating_point:
        return 0.0
    return (math.log(torch.finfo(dtype).max) - 1.0) ** 2


def _empty_stats(device: torch.device) -> dict[str, Tensor]:
    return {
        "masked_fraction": _scalar(0.0, device),
        "m2_before": _scalar(0.0, device),
        "m2_after": _scalar(0.0, device),
        "all_masked": _scalar(False, device, torch.bool),
    }


def _m2po_select(
    log_ratio: Tensor,
    mask: Tensor,
    threshold: float,
    advantages: Tensor | None = None,
    aligned_only: bool = False,
) -> tuple[Tensor, int, dict[str, Tensor], bool]:
    """Shared implementation of :func:`m2po_mask`.

    Returns ``(keep, n_valid, stats, ratios_finite)``: ``n_valid`` is a host int (read in the single host
    sync); ``stats`` holds detached 0-dim tensors ``masked_fraction``, ``m2_before``, ``m2_after``,
    ``all_masked``; ``ratios_finite`` says (from the same sync) that exp(log_ratio) is finite on EVERY
    position, padding included, which lets the loss skip guarding dropped tokens against inf * 0.

    Definitions (n = number of valid tokens; E = the tokens that may be dropped: all valid tokens, or with
    ``aligned_only`` only those whose ratio moves with their advantage; m = |E|; rem_k = sum of delta^2 over
    the valid tokens left after dropping the k tokens of E with the largest delta^2)::

        k* = min { k in [0, m] : n - k > 0  and  rem_k <= tau * (n - k) }

    The k* tokens of E with the largest delta^2 are dropped.  Ties: among equal delta^2 the token with the
    lower flat (row-major) index is dropped first.  If no k qualifies, no kept set of this form meets the
    bound and *nothing* is kept (``all_masked``).

    Lemma used by every path: a token with delta^2 <= tau is never dropped.  If the smallest dropped token had
    v <= tau, putting it back would keep the mean <= tau (both parts are <= tau), contradicting minimality of
    k*; and once the remaining mean is > tau, dropping a token with v <= tau only raises the mean.  So only
    the c "candidates" (tokens of E with delta^2 > tau) matter, and k* <= c when it exists.  (The remaining
    mean is non-increasing in k, since the largest remaining value is >= the mean.)

    Numerics: delta^2 is taken in float32 (float64 inputs are rounded to float32 first, half/bfloat16 inputs
    are upcast exactly); sums are accumulated in float64 and only ever add non-negative terms (no
    cancellation).  A NaN delta on a valid token makes the bound unverifiable, so nothing is kept; +inf is
    simply the largest delta^2 and is dropped first.
    """
    device = log_ratio.device
    shape = log_ratio.shape
    numel = log_ratio.numel()
    tau = float(threshold)
    if not tau >= 0.0:
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    tau32 = _float32_floor(tau)  # exact stand-in for tau in comparisons against float32 delta^2
    if aligned_only and advantages is None:
        raise ValueError("aligned_only=True needs the advantages")

    valid = mask.to(device=device, dtype=torch.bool)
    if valid.shape != shape:
        valid = valid.expand(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=torch.bool, device=device), 0, _empty_stats(device), False
    if numel >= 2**32:
        raise ValueError("m2po_mask supports fewer than 2**32 tokens per call")

    delta = log_ratio.detach()
    if delta.dtype != torch.float32:
        delta = delta.float()
    d2 = delta.square()  # float32 delta^2: the quantity that is ranked
    d2_valid = torch.where(valid, d2, 0.0)
    if aligned_only:
        adv = advantages.detach().to(device)
        if adv.dim() == 1 and len(shape) >= 2:
            adv = adv.unsqueeze(1)
        # The ratio moves with the advantage: (A > 0 and r > 1) or (A < 0 and r < 1); r > 1 <=> delta > 0.
        eligible = valid & (((adv > 0) & (delta > 0)) | ((adv < 0) & (delta < 0)))
        key = torch.where(eligible, d2, 0.0).reshape(-1)
    else:
        key = d2_valid.reshape(-1)
    # key > tau (>= 0) exactly marks the candidates; padding and non-droppable tokens have key 0.
    d2_flat = d2_valid.reshape(-1)

    # ---- everything the decisions need, read in ONE host sync -----------------------------------------
    # Fast path (b) looks at the k0 largest keys.  They travel to the host (k0 ~ numel/128 numbers) together
    # with n and r_rest = delta^2 sum over the valid tokens outside the top-k0 (summed on the device), so
    # the decisions cost a few vectorised numpy operations on k0 numbers instead of a dozen small device
    # kernels.  With t_j the delta^2 of the j-th largest key (j = 0..k0-1), for k <= k0:
    #     rem_k = r_rest + sum_{j >= k} t_j          and S = rem_0
    # sums of non-negative terms only (no cancellation, no inf - inf), depending on values only, so exact
    # whatever order topk gives to ties.
    k0 = _topk_size(numel)
    top_vals, top_idx = torch.topk(key, k0, largest=True, sorted=True)
    r_rest = d2_flat.index_fill(0, top_idx, 0.0).sum(dtype=torch.float64)
    parts = [top_vals]
    if aligned_only:  # key is 0 on valid non-droppable tokens: their delta^2 is needed separately
        parts.append(d2_flat[top_idx])
    parts += [valid.sum().view(1), r_rest.view(1), d2.max().view(1)]  # max over ALL positions (NaN propagates)
    on_cpu = _host_tensors(device)
    if not on_cpu:  # the general path needs the candidate count as a host int to stay sync-free
        parts.append((key > tau32).sum().view(1))
    packed = torch.cat(parts)  # promotes to float64 (r_rest): exact for float32 values and counts < 2^53
    host = packed.numpy() if on_cpu else packed.cpu().numpy()  # the single host sync
    base = 2 * k0 if aligned_only else k0
    top = host[:k0]  # keys, descending (float32 values, exact in float64)
    top_d2 = host[k0:base] if aligned_only else top
    n, r_rest_h = int(host[base]), float(host[base + 1])
    ratios_finite = bool(host[base + 2] < _exp_safe_d2(log_ratio.dtype))
    rev = np.cumsum(top_d2[::-1])  # rev[i] = sum of the last i + 1 top values
    s = r_rest_h + float(rev[-1])  # S = rem_0

    if n == 0:  # nothing valid: nothing kept, nothing to report
        return torch.zeros(shape, dtype=torch.bool, device=device), 0, _empty_stats(device), ratios_finite

    m2_before = s / n
    if s <= tau * n:
        # Fast path (a): the bound already holds, k* = 0.  No sort, nothing to drop.
        keep = valid.clone() if (valid is mask or valid.stride() != d2.stride()) else valid
        stats = {
            "masked_fraction": _scalar(0.0, device),
            "m2_before": _scalar(m2_before, device),
            "m2_after": _scalar(m2_before, device),
            "all_masked": _scalar(False, device, torch.bool),
        }
        return keep, n, stats, ratios_finite

    rem_top = np.empty(k0)  # rem_k for k = 1..k0 (position k - 1)
    rem_top[:-1] = rev[-2::-1]
    rem_top[-1] = 0.0
    rem_top += r_rest_h
    ks = np.arange(1, k0 + 1, dtype=np.float64)
    ok = rem_top <= tau * (n - ks)
    ok &= top > tau  # the k-th largest must be a candidate (exact: float32 values vs tau in float64)
    ok &= ks < n
    first = int(np.argmax(ok))
    # To resolve ties inside the top-k0, every token with key == top[first] must be there.
    if ok[first] and (k0 == numel or top[first] > top[-1]):
        # Fast path (b): k* = first + 1 lies inside the top-k0.
        k_star = first + 1
        if k_star == k0 or top[k_star] != top[first]:  # the cut does not split equal values
            drop = top_idx[:k_star]
        else:  # order the top-k0 by (value desc, flat index asc), see the general path below
            drop = top_idx[_rank_desc_then_index(top_vals, top_idx)[:k_star]]
        keep_flat = valid.reshape(-1).index_fill(0, drop, False)
        stats = {
            "masked_fraction": _scalar(k_star / n, device),
            "m2_before": _scalar(m2_before, device),
            "m2_after": _scalar(float(rem_top[first]) / (n - k_star), device),
            "all_masked": _scalar(False, device, torch.bool),
        }
        return keep_flat.view(shape), n, stats, ratios_finite

    # General path: sort only the c candidates (the lemma) -- one sort and one cumulative sum, no further
    # sync.  For k in [0, c]: rem_k = r0 + (candidates ranked k..c-1), r0 = delta^2 sum over the valid
    # non-candidates, both sums of non-negative terms (+inf handled).
    cand = key > tau32
    if on_cpu:
        cand_idx = cand.nonzero().squeeze(1)  # ascending flat index
    else:
        # ascending flat index; the size came with the single sync, so no further one here
        cand_idx = torch.nonzero_static(cand, size=int(host[base + 3])).squeeze(1)
    c = cand_idx.numel()
    cand_vals = key[cand_idx]
    # The one sort: rank by (delta^2 desc, flat index asc) -> among equal delta^2 the lower index goes first.
    order = _rank_desc_then_index(cand_vals, cand_idx)
    sorted_vals = cand_vals[order]
    r0 = torch.where(cand, 0.0, d2_flat).sum(dtype=torch.float64)
    suffix = sorted_vals.to(torch.float64).flip(0).cumsum(0).flip(0)  # suffix[k] = sum of sorted_vals[k:]
    rem = torch.cat([suffix, suffix.new_zeros(1)]) + r0  # rem_k, k = 0..c
    kk = torch.arange(c + 1, dtype=torch.float64, device=device)
    cond = ((n - kk) > 0) & (rem <= tau * (n - kk))
    found = cond.any()
    k_star_t = torch.argmax(cond.to(torch.uint8))
    keep_flat = valid.reshape(-1).clone()
    keep_flat[cand_idx[order]] = torch.arange(c, device=device) >= k_star_t  # ranks < k* are dropped
    keep_flat &= found  # no admissible k: keep nothing
    k_f = k_star_t.to(torch.float64)
    stats = {
        "masked_fraction": torch.where(found, k_f / n, 1.0).float(),
        "m2_before": _scalar(m2_before, device),
        "m2_after": torch.where(found, rem[k_star_t] / (n - k_f).clamp(min=1.0), 0.0).float(),
        "all_masked": ~found,
    }
    return keep_flat.view(shape), n, stats, ratios_finite


def m2po_mask(
    log_ratio: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    advantages: Tensor | None = None,
    aligned_only: bool = False,
) -> Tensor:
    """M2PO second-moment mask (Zheng et al. 2025, arXiv:2510.01161). True where a token is KEPT.

    Args:
        log_ratio: ``delta = log pi_theta - log mu``, any shape (typically ``(B, T)``); used detached.
        mask: valid-token mask (bool or 0/1), same shape as ``log_ratio`` (or broadcastable to it).
        threshold: ``tau_M2``; the kept tokens satisfy ``mean(delta^2) <= threshold``.
        advantages: ``(B,)`` or ``(B, T)``; only needed with ``aligned_only``.
        aligned_only: the authors' later variant: only tokens whose ratio moves with their advantage,
            ``(A > 0 and r > 1) or (A < 0 and r < 1)``, may be dropped; the others are always kept (unless
            nothing can be kept at all) and always count in the mean.

    Rule: among the valid (droppable) tokens, drop the smallest number k of tokens with the largest
    ``delta^2`` such that the mean ``delta^2`` of the remaining *valid* tokens is ``<= threshold``.  The
    selection scope is the whole tensor passed in (one micro-batch on one rank, as in AReaL).

    * Padding is never kept and never counted.  No valid tokens -> all False.
    * Ties: among equal ``delta^2`` the token with the lower flat (row-major) index is dropped first.
    * If no non-empty kept set of this form satisfies the bound (e.g. every valid ``delta^2`` > threshold),
      NOTHING is kept (all False); :func:`m2po_loss` then returns a zero loss with a graph and reports
      ``all_masked=True``.  A NaN ``delta`` on a valid token gives the same outcome.
    * ``delta^2`` is ranked in float32, sums are accumulated in float64.

    Cost: one host sync per call (a single device-to-host read of one small packed tensor).  Fast path (a): the mean over all valid tokens is
    already within the bound -> keep all valid tokens, no sort.  Fast path (b): the answer lies within the
    ``~numel/128`` largest ``delta^2`` -> decided from ``torch.topk`` partial sums.  Otherwise one sort (of the
    tokens with ``delta^2 > threshold`` only -- no other token is ever dropped) and one cumulative sum.  All
    paths give exactly the same mask as the brute-force search over k.
    """
    keep = _m2po_select(log_ratio, mask, threshold, advantages, aligned_only)[0]
    return keep


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1 and like.dim() >= 2:
        advantages = advantages.unsqueeze(1)  # (B,) -> (B, 1), as TRL does
    return advantages


def m2po_loss(
    per_token_logps: Tensor,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    normalizer: Tensor | float | None = None,
    *,
    aligned_only: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO loss (Zheng et al. 2025, arXiv:2510.01161), the paper's rule.

    ``delta_t = per_token_logps - behaviour_logps``, ``r_t = exp(delta_t)``,
    ``M = m2po_mask(delta.detach(), mask, threshold)``, ``J = (1/N) sum_t M_t r_t A_t`` (no epsilon-clip),
    ``loss = -J``.  The gradient flows through ``r_t``: ``d loss / d per_token_logps_t = -M_t r_t A_t / N``.

    Args:
        per_token_logps: ``log pi_theta``, shape ``(B, T)``, requires grad.
        behaviour_logps: ``log mu`` of the policy that sampled the tokens, same shape.
        advantages: ``(B,)`` (unsqueezed to ``(B, 1)``) or ``(B, T)``.
        mask: valid-token mask, ``(B, T)``.
        threshold: ``tau_M2`` (0.04 in the paper).
        normalizer: N.  The trainer passes TRL ``dapo``'s normaliser.  Default: the number of valid tokens
            before masking, clamped to >= 1.  A non-positive tensor normaliser is replaced by 1 (there is then
            nothing to normalise); a non-positive number raises ``ValueError``.
        aligned_only: forward to :func:`m2po_mask` (the authors' later variant).

    Returns:
        ``(loss, stats)``; stats are detached 0-dim tensors (no host sync is spent on them):
        ``masked_fraction`` (dropped valid / valid), ``m2_before`` (mean delta^2 over valid tokens),
        ``m2_after`` (mean delta^2 over kept tokens, 0 if none), ``all_masked`` (bool: there were valid
        tokens and none was kept).  When ``all_masked`` the loss is an exact zero that still has a graph
        (backward gives zero gradients); the caller should warn and skip the step.

    Dropped tokens and padding enter neither the value nor the gradient (weight exactly 0).  When some ratio
    is not finite (inf/NaN log-probs, or exp overflow), their ``delta`` is replaced by ``-inf`` before the
    ``exp`` instead, so inf * 0 = NaN cannot leak in.  Low-precision log-probs (bf16/fp16) are accumulated
    in the advantages' dtype (float32), as TRL does.
    """
    delta = per_token_logps - behaviour_logps
    adv = _broadcast_advantages(advantages.detach(), delta)
    keep, n_valid, stats, ratios_finite = _m2po_select(delta, mask, threshold, adv, aligned_only)

    if ratios_finite:
        # Every exp(delta) is finite (checked in the mask's single sync), so the mask can ride on the
        # advantages: weight 0 on dropped tokens and padding, zero value and zero gradient there.
        objective_sum = (torch.exp(delta) * (keep * adv)).sum()
    else:
        # Some ratio is inf/NaN (or would overflow): replace delta by -inf wherever the mask is off, so the
        # ratio there is exactly 0 and inf * 0 = NaN cannot leak into the value or the gradient.
        objective_sum = (torch.exp(torch.where(keep, delta, float("-inf"))) * adv).sum()

    if normalizer is None:
        loss = objective_sum * (-1.0 / max(n_valid, 1))
    elif isinstance(normalizer, Tensor):
        denom = torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer)).to(objective_sum.dtype)
        loss = -objective_sum / denom
    else:
        if not float(normalizer) > 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer!r}")
        loss = objective_sum * (-1.0 / float(normalizer))
    return loss, stats


def reference_m2po_loss(
    per_token_logps: Tensor,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    gamma: float = 2.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token rule printed by a public reference page -- NOT the published M2PO (see :func:`m2po_loss`).

    Kept so its variance-vs-staleness table can be reproduced beside the paper's rule::

        r_t = exp(logp_t - logmu_t)
        m_t = 1[r_t^2 <= gamma]        on valid tokens only (padding is never kept)
        L   = -(1 / max(1, sum_t m_t)) * sum_t m_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    Returns ``(loss, stats)`` with the same stats keys as :func:`m2po_loss` (``masked_fraction`` is the share
    of valid tokens with ``m_t = 0``).  No host sync.
    """
    delta = per_token_logps - behaviour_logps
    advantages = _broadcast_advantages(advantages, delta)
    valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)

    d = delta.detach()
    keep = valid & (torch.exp(d).square() <= gamma)
    safe_delta = torch.where(keep, delta, 0.0)  # dropped tokens: no inf/NaN in forward or backward
    ratio = torch.exp(safe_delta)
    adv = advantages.detach()
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = torch.minimum(ratio * adv, clipped * adv)
    kept_n = keep.sum()
    loss = -torch.where(keep, per_token, 0.0).sum() / kept_n.clamp(min=1).to(per_token.dtype)

    d2 = d.float().square()
    n = valid.sum()
    n_f = n.clamp(min=1).to(torch.float64)
    stats = {
        "masked_fraction": ((n - kept_n).to(torch.float64) / n_f).float(),
        "m2_before": (torch.where(valid, d2, 0.0).sum(dtype=torch.float64) / n_f).float(),
        "m2_after": (
            torch.where(keep, d2, 0.0).sum(dtype=torch.float64) / kept_n.clamp(min=1).to(torch.float64)
        ).float(),
        "all_masked": (kept_n == 0) & (n > 0),
    }
    return loss, stats
