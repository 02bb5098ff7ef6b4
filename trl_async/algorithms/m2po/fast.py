"""The vectorized selection the trainers use: :func:`m2po_select` (and :func:`m2po_mask`) over one tensor.

Rules ``"paper"`` (Algorithm 1, ``reference.py``) and ``"all_tokens"`` share one machinery here: only the candidate
set differs (the trust-region tokens, or every valid token).  ``"authors_code"`` is dispatched to ``authors_code.py``.
The selection covers the tensor it is given (one micro-batch on one rank, as the authors' code and AReaL do);
``global_scope.py`` selects over every rank's tokens.

How it stays cheap: a candidate with delta^2 <= tau is never masked (the lemma in :func:`m2po_select`), so only the
candidates above tau are ever sorted, and two fast paths avoid even that:

* fast path (a): the bound already holds -- nothing to sort, nothing to mask;
* fast path (b): the answer lies within the ~numel/128 largest delta^2 -- decided from ``torch.topk`` partial sums;
* otherwise one sort of the candidates above tau and one cumulative sum (``_drop_count``).

Host memory or an accelerator: reading a CPU tensor costs nothing, so on CPU the selection reads its counts first and
often decides there; on an accelerator it makes one packed device-to-host read.  ``host_memory=False`` runs the
accelerator path on any device (``None``, the default, decides from the tensors' device), which is how that path is
tested on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
from torch import Tensor

from .authors_code import _select_authors
from .selection import (
    M2POSelection,
    _at,
    _check_floors,
    _check_rule,
    _device_sums,
    _drop_count,
    _empty_selection,
    _exp_safe_max,
    _float32_floor,
    _in_host_memory,
    _nan_selection,
    _prepare,
    _rank_desc_then_index,
    _Tokens,
)
from .stats import _host_vector, _stats_from_device, _stats_from_host

# Fast path (b) looks at the top-k0 largest delta^2 first, with k0 = max(_TOPK_MIN, ceil(numel * _TOPK_FRACTION))
# (capped at numel).  k0 is derived from numel because the number of candidates is only known after the host
# sync.  With ~50% padding this covers ~1.6% of the valid tokens, enough for the "slightly stale" regime.
_TOPK_FRACTION = 1.0 / 128.0
_TOPK_MIN = 16


def m2po_select(
    log_ratio: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    advantages: Tensor | None = None,
    rule: str = "paper",
    *,
    clip_floor_low: float | None = None,
    clip_floor_high: float | None = None,
    host_memory: bool | None = None,
) -> M2POSelection:
    """Select the tokens that carry gradient under one M2PO rule, over the whole tensor given.

    Args:
        log_ratio: ``delta = log pi_theta - log mu``, any shape (typically ``(B, T)``); used detached.
        mask: valid-token mask (bool or 0/1), same shape as ``log_ratio`` (or broadcastable to it).
        threshold: ``tau_M2`` (0.04 in the paper), >= 0.
        advantages: ``(B,)`` (broadcast over tokens) or the shape of ``log_ratio``.  Required by ``"paper"`` and
            ``"authors_code"``; optional for ``"all_tokens"`` (then the trust-region stats are 0).
        rule: ``"paper"``, ``"all_tokens"`` or ``"authors_code"`` (see the package docstring, ``m2po/__init__.py``).
        clip_floor_low, clip_floor_high: ``"authors_code"`` only: the authors' ``miniclip_low`` /
            ``miniclip_high`` (None = off, as in every script they ship).
        host_memory: read the tensors as host memory (True) or accelerator memory (False); None: from their device.

    Rules "paper" / "all_tokens": the k* candidates with the largest delta^2 are masked, k* the smallest k for
    which the candidates left have mean delta^2 <= threshold.  Ties: among equal delta^2 the token with the lower
    flat (row-major) index is masked first.  "all_tokens" with no admissible k masks everything (``all_masked``).
    Padding is never kept and never counted.  A NaN delta on a valid token makes any bound unverifiable: nothing is
    kept (``all_masked``); under "paper" / "authors_code" so does an infinite delta with A = 0 on a valid token
    (its trust-region membership, sign(A) * delta, is undefined).  +inf is simply the largest delta^2.

    Lemma used by every path: a candidate with delta^2 <= tau is never masked (if the smallest masked value v
    were <= tau, putting it back would keep the mean <= tau, contradicting minimality; once the remaining mean is
    > tau, masking a value <= tau only raises it).  So only candidates above tau are ever sorted.

    Cost on an accelerator: one host sync (a single device-to-host read of one small packed tensor).  Fast path
    (a): the bound already holds -> nothing to sort.  Fast path (b): the answer lies within the ~numel/128 largest
    candidates -> decided from ``torch.topk`` partial sums.  Otherwise one sort of the candidates above tau and one
    cumulative sum.  On CPU (host memory: reading waits for nothing) the sums are read first and the top-k is only
    taken when the bound is broken.  "authors_code": one read, and one sort of the harmful tokens when the budget is
    broken.  delta^2 is ranked in float32 (float64 inputs are rounded to float32 first), the sums that decide are
    accumulated in float64.
    """
    _check_rule(rule)
    _check_floors(rule, clip_floor_low, clip_floor_high)
    tau = float(threshold)
    if not tau >= 0.0:
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    shape, device, numel = log_ratio.shape, log_ratio.device, log_ratio.numel()
    if numel == 0:
        return _empty_selection(shape, device)
    if numel >= 2**32:
        raise ValueError("m2po_select supports fewer than 2**32 tokens per call")
    tok = _prepare(log_ratio, mask, advantages, rule)
    on_host = _in_host_memory(device, host_memory)
    if rule == "authors_code":
        return _select_authors(tok, tau, log_ratio.dtype, clip_floor_low, clip_floor_high, on_host)
    if on_host:
        return _select_by_masking_host(tok, tau, rule, log_ratio.dtype)
    return _select_by_masking(tok, tau, rule, log_ratio.dtype, on_host=False)


def m2po_mask(
    log_ratio: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    advantages: Tensor | None = None,
    rule: str = "paper",
    *,
    host_memory: bool | None = None,
) -> Tensor:
    """M2PO mask (Zheng et al. 2025, arXiv:2510.01161): True where a token carries gradient.

    ``m2po_select(...).keep``; see :func:`m2po_select` for the rules, ties, padding, NaN and cost.  Under
    ``"authors_code"`` the tokens that are not kept are those the PPO clip holds at its bound.
    """
    return m2po_select(log_ratio, mask, threshold, advantages, rule, host_memory=host_memory).keep


# --------------------------------------------------------------------------------------------------------------
# rules "paper" / "all_tokens"
# --------------------------------------------------------------------------------------------------------------


def _topk_size(numel: int) -> int:
    return min(numel, max(_TOPK_MIN, math.ceil(numel * _TOPK_FRACTION)))


@functools.cache
def _arange_from_1(k0: int) -> np.ndarray:
    ks = np.arange(1, k0 + 1, dtype=np.float64)
    ks.flags.writeable = False
    return ks


def _stat_scalars(tok: _Tokens, paper: bool) -> list:
    """The per-call scalars besides the ranking: [valid count, max delta over ALL positions (NaN propagates),
    trust-region count, delta^2 sum for the stats (over valid tokens for "paper", over trust-region tokens
    otherwise, there a float32 dot)] -- the last two only when advantages are given."""
    scalars = [tok.valid.sum(), tok.delta.max()]
    if paper:  # (float64: the kept tokens' sum is taken from it by difference)
        scalars += [torch.count_nonzero(tok.r), tok.d2.sum(dtype=torch.float64)]
    elif tok.r is not None:
        r_flat = tok.r.reshape(-1)
        scalars += [torch.count_nonzero(tok.r), torch.dot(r_flat, r_flat)]
    return scalars


def _select_by_masking_host(tok: _Tokens, tau: float, rule: str, ratio_dtype: torch.dtype) -> M2POSelection:
    """Rules "paper" and "all_tokens" for tensors in host memory (CPU), where reading a value costs no sync.

    First the counts and sums alone: when the bound already holds (the common, near on-policy case) that decides,
    and the top-k is skipped.  Otherwise the accelerator path runs with these scalars already known.  Same answers
    (both paths are tested against the brute force).
    """
    paper = rule == "paper"
    key = tok.r.square() if paper else tok.d2
    scalars = _stat_scalars(tok, paper)
    host = [x.item() for x in (*scalars, key.sum(dtype=torch.float64))]  # host memory: reads, no device sync
    known, s_cand = host[:-1], host[-1]
    n_valid = int(known[0])
    n_cand = int(known[2]) if paper else n_valid
    if n_valid and s_cand <= tau * n_cand:  # the bound already holds: nothing to rank, nothing to mask
        valid = tok.valid
        ratios_finite = known[1] < _exp_safe_max(ratio_dtype)
        if paper:
            n_tr, sum_valid, sum_tr = n_cand, known[3], s_cand
        else:
            sum_valid = s_cand
            n_tr, sum_tr = (int(known[2]), known[3]) if tok.r is not None else (0, 0.0)
        if not math.isnan(sum_valid):
            sums = [n_valid, n_valid, n_tr, n_tr, sum_valid, sum_valid, sum_tr, sum_tr, 0.0]
            keep = valid if tok.owned else valid.clone()
            stats = _stats_from_host(sums, valid.device)
            return M2POSelection(keep, stats, n_valid=n_valid, ratios_finite=ratios_finite)
    return _select_by_masking(tok, tau, rule, ratio_dtype, key=key, known=known, s_key=s_cand, on_host=True)


def _select_by_masking(
    tok: _Tokens,
    tau: float,
    rule: str,
    ratio_dtype: torch.dtype,
    key: Tensor | None = None,
    known: list | None = None,
    s_key: float | None = None,
    *,
    on_host: bool,
) -> M2POSelection:
    """Rules "paper" and "all_tokens" (see :func:`m2po_select`), in one packed device-to-host read.

    ``key`` / ``known`` / ``s_key``: the candidates' delta^2, the :func:`_stat_scalars` and the float64 sum of
    ``key``, already read (host path)."""
    valid = tok.valid
    device, shape = valid.device, valid.shape
    paper = rule == "paper"
    if key is None:
        # key > tau (>= 0) exactly marks the candidates that may be masked; padding and non-candidates have key 0.
        # (r^2 equals delta^2 bit for bit: squaring ignores the sign.)
        key = tok.r.square() if paper else tok.d2
    top = _read_top_keys(tok, key, tau, paper, known, s_key, on_host)
    known = top.known
    n_valid = int(known[0])
    ratios_finite = bool(known[1] < _exp_safe_max(ratio_dtype))
    if paper:
        n_cand = n_tr = int(known[2])
        sum_valid, sum_tr = known[3], top.s_cand
    else:
        n_cand, sum_valid = n_valid, top.s_cand
        n_tr, sum_tr = (int(known[2]), known[3]) if tok.r is not None else (0, 0.0)

    if n_valid == 0:  # nothing valid: nothing kept, nothing to report
        return _empty_selection(shape, device, ratios_finite)
    if math.isnan(sum_valid) or math.isnan(top.s_cand):
        return _nan_selection(tok, n_valid, ratios_finite)

    if top.s_cand <= tau * n_cand:
        # Fast path (a): the bound already holds, k* = 0.  No sort, nothing to mask.
        keep = valid if tok.owned else valid.clone()  # never alias the caller's mask
        sums = [n_valid, n_valid, n_tr, n_tr, sum_valid, sum_valid, sum_tr, sum_tr, 0.0]
        return M2POSelection(keep, _stats_from_host(sums, device), n_valid=n_valid, ratios_finite=ratios_finite)

    counts = (n_valid, n_cand, n_tr, sum_valid, sum_tr)
    selection = _drop_within_top(tok, top, tau, rule, counts, ratios_finite)
    if selection is None:
        selection = _drop_by_sort(tok, key, top, tau, rule, counts, ratios_finite, on_host)
    return selection


@dataclasses.dataclass
class _TopKeys:
    """What the decisions of :func:`_select_by_masking` need, read in one host sync."""

    values: Tensor  # the k0 largest keys, descending (device)
    indices: Tensor  # their flat indices (device)
    top: np.ndarray  # the same values on the host, float64
    rest: float  # candidate delta^2 sum outside the top-k0
    s_cand: float  # S: the delta^2 sum over every candidate
    known: list  # the _stat_scalars
    n_above_tau: int | None  # candidates above tau (accelerator path only, sizes nonzero_static)


def _read_top_keys(tok: _Tokens, key: Tensor, tau: float, paper: bool, known, s_key, on_host: bool) -> _TopKeys:
    """The k0 largest keys with the counts and r_rest = the candidates' delta^2 sum outside the top-k0 (summed on the
    device), read together, so the decisions cost a few vectorised numpy operations on k0 numbers instead of a dozen
    small device kernels. With t_j the j-th largest key (j = 0..k0-1), for k <= k0:
        rem_k = r_rest + sum_{j >= k} t_j          and S = rem_0
    sums of non-negative terms only (no cancellation, no inf - inf), exact whatever order topk gives to ties."""
    key_flat = key.reshape(-1)
    k0 = _topk_size(key_flat.numel())
    top_vals, top_idx = torch.topk(key_flat, k0, largest=True, sorted=True)
    n_above_tau = None
    if on_host and s_key is not None and math.isfinite(s_key):
        # The host path already summed key: r_rest by difference, one reduction less.  (Both are float64 sums of
        # float32 values: the difference is off by ~1e-16 of the total at most, far below float32 resolution, and
        # exact on dyadic data; the total is finite, so no inf - inf.)
        top = top_vals.numpy().astype(np.float64)
        host = [max(s_key - float(top.sum()), 0.0)]
    elif on_host:  # host memory: reading is free (and item() is cheaper than packing)
        r_rest = key_flat.index_fill(0, top_idx, 0.0).sum(dtype=torch.float64)
        top = top_vals.numpy().astype(np.float64)
        host = [x.item() for x in [r_rest] + (_stat_scalars(tok, paper) if known is None else [])]
    else:
        r_rest = key_flat.index_fill(0, top_idx, 0.0).sum(dtype=torch.float64)
        scalars = [r_rest] + (_stat_scalars(tok, paper) if known is None else [])
        scalars.append((key_flat > _float32_floor(tau)).sum())  # the general path needs the candidate count sync-free
        # Promotes to float64 (r_rest): exact for float32 values and counts < 2^53.
        packed = torch.cat([top_vals, torch.stack(scalars)]).cpu().numpy()  # the single host sync
        top, host = packed[:k0], [float(x) for x in packed[k0:]]  # keys descending (float32 values, exact)
        n_above_tau = int(host.pop())
    rest = host[0]
    rev = np.cumsum(top[::-1])  # rev[i] = sum of the last i + 1 top values
    return _TopKeys(
        values=top_vals,
        indices=top_idx,
        top=top,
        rest=rest,
        s_cand=rest + float(rev[-1]),
        known=host[1:] if known is None else known,
        n_above_tau=n_above_tau,
    )


def _drop_within_top(
    tok: _Tokens, top: _TopKeys, tau: float, rule: str, counts, ratios_finite
) -> M2POSelection | None:
    """Fast path (b): k* lies inside the top-k0 keys, decided from their partial sums (no sort). None otherwise."""
    n_valid, n_cand, n_tr, sum_valid, sum_tr = counts
    valid, paper = tok.valid, rule == "paper"
    shape, numel, k0 = valid.shape, valid.numel(), top.top.size
    values = top.top
    rev = np.cumsum(values[::-1])
    rem_top = np.append(rev[-2::-1], 0.0) + top.rest  # rem_k for k = 1..k0 (position k - 1)
    ks = _arange_from_1(k0)
    ok = rem_top <= tau * (n_cand - ks)
    ok &= values > tau  # the k-th largest must be a candidate above tau (exact: float32 values vs tau in float64)
    if not paper:
        ok &= ks < n_cand
    first = int(np.argmax(ok))
    # To resolve ties inside the top-k0, every token with key == values[first] must be there.
    if not (ok[first] and (k0 == numel or values[first] > values[-1])):
        return None
    k_star = first + 1
    if k_star == k0 or values[k_star] != values[first]:  # the cut does not split equal values
        drop = top.indices[:k_star]
    else:  # order the top-k0 by (value desc, flat index asc), see `_drop_by_sort`
        drop = top.indices[_rank_desc_then_index(top.values, top.indices)[:k_star]]
    flat_valid = valid.reshape(-1)
    # No copy when valid is ours and nothing reads it afterwards ("paper": the stats come from the host).
    fill = flat_valid.index_fill_ if (tok.owned and paper) else flat_valid.index_fill
    keep = fill(0, drop, False).view(shape)
    dropped_sum = top.s_cand - float(rem_top[first])
    if paper:  # every masked token is a trust-region token
        sums = [n_valid, n_valid - k_star, n_tr, n_tr - k_star]
        sums += [sum_valid, sum_valid - dropped_sum, sum_tr, sum_tr - dropped_sum, float(k_star == n_valid)]
        stats = _stats_from_host(sums, valid.device)
    else:
        stats = _stats_from_device(_device_sums(tok, keep))
    return M2POSelection(keep, stats, n_valid=n_valid, ratios_finite=ratios_finite)


def _drop_by_sort(
    tok: _Tokens, key: Tensor, top: _TopKeys, tau: float, rule: str, counts, ratios_finite, on_host: bool
) -> M2POSelection:
    """General path: sort only the c candidates above tau (the lemma) -- one sort and one cumulative sum, no further
    sync."""
    n_valid, n_cand, n_tr, sum_valid, sum_tr = counts
    valid, paper = tok.valid, rule == "paper"
    device, shape = valid.device, valid.shape
    key_flat = key.reshape(-1)
    cand = key_flat > _float32_floor(tau)  # exact stand-in for tau in comparisons against float32 delta^2
    if on_host:
        cand_idx = cand.nonzero().squeeze(1)  # ascending flat index
    else:
        # ascending flat index; the size came with the single sync, so no further one here
        cand_idx = torch.nonzero_static(cand, size=top.n_above_tau).squeeze(1)
    c = cand_idx.numel()
    cand_vals = key_flat[cand_idx]
    # The one sort: rank by (delta^2 desc, flat index asc) -> among equal delta^2 the lower index goes first.
    order = _rank_desc_then_index(cand_vals, cand_idx)
    small_sum = torch.where(cand, 0.0, key_flat).sum(dtype=torch.float64)
    k_star_t, found, rem = _drop_count(cand_vals[order], n_cand, small_sum, tau, rule)
    keep_flat = valid.reshape(-1).clone()
    keep_flat[cand_idx[order]] = torch.arange(c, device=device) >= k_star_t  # ranks < k* are masked
    keep_flat &= found  # no admissible k ("all_tokens"): keep nothing
    keep = keep_flat.view(shape)
    if paper:
        k_f = k_star_t.to(torch.float64)
        rem_kept = _at(rem, k_star_t)  # rem_{k*}: the kept candidates' delta^2 sum (no host read of k*)
        dropped_sum = rem[0] - rem_kept
        host_part = _host_vector([n_valid, n_tr, sum_valid, sum_tr], device)
        sums = torch.stack(
            [
                host_part[0],
                n_valid - k_f,
                host_part[1],
                n_tr - k_f,
                host_part[2],
                sum_valid - dropped_sum,
                host_part[3],
                rem_kept,
                (k_f == n_valid).to(torch.float64),
            ]
        )
    else:
        sums = _device_sums(tok, keep)
    return M2POSelection(keep, _stats_from_device(sums), n_valid=n_valid, ratios_finite=ratios_finite)
