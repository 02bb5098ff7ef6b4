"""Policy-gradient losses for asynchronous (stale) rollouts.

Pure tensor functions: no trainer state, nothing imported from the rest of ``trl_async``.

M2PO -- Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far
Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).  With behaviour policy mu (the policy
that sampled the tokens) and current policy pi_theta, per valid completion token t::

    delta_t = log pi_theta(y_t | .) - log mu(y_t | .)          (log importance ratio)
    r_t     = exp(delta_t)

A token is a *trust-region token* when its ratio moves with its advantage, the two quadrants in which PPO's clip
would bind::

    (A_t > 0 and delta_t > 0)  or  (A_t < 0 and delta_t < 0)

Three selection rules, each named after its source (``rule=``; docs/m2po.md has the table):

``"paper"`` (default) -- Algorithm 1 of the paper, as printed in its figure (Infini-AI-Lab/M2PO
    ``docs/static/m2po-images/alg.jpg``, AReaL ``docs/figures/m2po_masking.png``) and as ms-swift (PR #9965) and
    Trinity-RFT (PR #616, ``trinity/algorithm/policy_loss_fn/m2po_policy_loss.py``) implement it:
    T <- all trust-region tokens; while mean_{i in T} delta_i^2 > tau_M2, drop the largest from T.  Tokens outside
    the trust region are never masked.  Objective J = (1/N) sum_t M_t r_t A_t, no epsilon-clip, N = valid tokens
    before masking.
``"all_tokens"`` -- every valid token is a candidate and the mean is over all remaining valid tokens: AReaL's
    candidate set (PR #480, ``areal/engine/ppo/actor.py``), and what wave 1 shipped.  If no non-empty kept set meets
    the bound, nothing is kept and the call is flagged ``all_masked`` (never a silent division by zero).
``"authors_code"`` -- what the authors' training code computes (Infini-AI-Lab/M2PO
    ``verl/trainer/ppo/core_algos.py``, ``kpo_clip_harmful_tokens`` / ``_solve_tau_from_sorted_delta2`` /
    ``compute_m2po_policy_loss``), and so what produced the paper's numbers: over the harmful (trust-region) tokens
    it finds a cut tau_c at which the mean of min(delta^2, tau_c^2) is <= tau_M2 and applies the PPO clip
    [exp(-tau_c), exp(tau_c)]; no clip when the budget already holds.  Optional floors (their ``miniclip_low`` /
    ``miniclip_high``, 0.3 / 0.5 in the function signature) are off in every shipped script and off by default here.

All three are computed on the detached delta.  The gradient is d loss / d log pi_t = -w_t r_t A_t / N with
w_t = 1 on kept tokens, 0 on masked (or clipped) ones.

Selection scope: :func:`m2po_select` selects over the tensor it is given (one micro-batch on one rank, as the
authors' code and AReaL do).  :func:`m2po_select_global` selects over the whole optimizer batch across the ranks of
a process group, as the ms-swift and Trinity PRs do, and gives the same answer as :func:`m2po_select` on the
concatenation of every rank's tokens.

:func:`m2po_mask_reference` is Algorithm 1 written one token at a time, to read beside the vectorized path (and
to test it against); the trainers use :func:`m2po_select`.

Host memory or an accelerator: reading a CPU tensor costs nothing, so on CPU the selection reads its counts first and
often decides there; on an accelerator it makes one packed device-to-host read.  ``host_memory=False`` runs the
accelerator path on any device (``None``, the default, decides from the tensors' device), which is how that path is
tested on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "M2PO_RULES",
    "M2PO_SCOPES",
    "M2PO_STAT_KEYS",
    "M2PO_SUM_KEYS",
    "M2POSelection",
    "M2POStats",
    "m2po_loss",
    "m2po_mask",
    "m2po_metrics",
    "m2po_select",
    "m2po_mask_reference",
    "m2po_select_global",
]

M2PO_RULES = ("paper", "all_tokens", "authors_code")
M2PO_SCOPES = ("micro_batch", "global")

# Raw per-call quantities (float64), summable across micro-batches and ranks; :func:`m2po_metrics` turns a sum of
# them into the logged figures.  "d2" is delta^2; "kept" means the token carries gradient (not masked / clipped).
M2PO_SUM_KEYS = (
    "valid_tokens",
    "kept_tokens",
    "trust_region_tokens",
    "kept_trust_region_tokens",
    "d2_sum",
    "d2_sum_kept",
    "d2_sum_trust_region",
    "d2_sum_kept_trust_region",
    "all_masked_batches",
)
# The figures derived from them (also returned per call in ``stats``).
M2PO_STAT_KEYS = (
    "masked_fraction",
    "m2_before",
    "m2_after",
    "trust_region_fraction",
    "m2_before_trust_region",
    "m2_after_trust_region",
)

# Fast path (b) looks at the top-k0 largest delta^2 first, with k0 = max(_TOPK_MIN, ceil(numel * _TOPK_FRACTION))
# (capped at numel).  k0 is derived from numel because the number of candidates is only known after the host
# sync.  With ~50% padding this covers ~1.6% of the valid tokens, enough for the "slightly stale" regime.
_TOPK_FRACTION = 1.0 / 128.0
_TOPK_MIN = 16
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# The authors' code compares with these slacks (``1e-12`` in ``kpo_clip_harmful_tokens`` and
# ``_solve_tau_from_sorted_delta2``); "authors_code" keeps them so that it decides exactly as their code does.
_AUTHORS_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class M2POSelection:
    """Which tokens carry gradient, as decided by one M2PO rule.

    Attributes:
        keep: bool, shape of the log ratio; True where the token enters the loss with its gradient.
        stats: a read-only mapping (:class:`M2POStats`): ``sums``, a float64 vector of ``M2PO_SUM_KEYS`` (sum it
            over micro-batches and ranks, then call :func:`m2po_metrics`); the ``M2PO_STAT_KEYS`` and ``all_masked``
            (bool), detached 0-dim tensors derived from ``sums`` when read; for ``"authors_code"`` also
            ``clip_log_bound`` (tau_c; +inf when nothing is clipped).
        clipped: ``"authors_code"`` only, and only when a clip binds: bool mask of the valid tokens whose ratio the
            PPO clip replaces by its bound (they add A * exp(bound) to the objective, without gradient).
        clip_log_low, clip_log_high: ``"authors_code"`` with a binding clip: the clip bounds in log space (0-dim).
        n_valid: number of valid tokens (host int), or None when only known on the device (global selection).
        ratios_finite: True when exp(log_ratio) is finite at every position (lets the loss skip its inf * 0 guard).
    """

    keep: Tensor
    stats: M2POStats
    clipped: Tensor | None = None
    clip_log_low: Tensor | None = None
    clip_log_high: Tensor | None = None
    n_valid: int | None = None
    ratios_finite: bool = False


# --------------------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------------------


def _topk_size(numel: int) -> int:
    return min(numel, max(_TOPK_MIN, math.ceil(numel * _TOPK_FRACTION)))


def _float32_floor(x: float) -> float:
    """Largest float32 value <= x.  For a float32 y:  y > x  <=>  y > _float32_floor(x), so comparing a
    float32 tensor against it (torch compares in the tensor's dtype) is exact for the real threshold x."""
    if x >= _FLOAT32_MAX:
        return x if math.isinf(x) else _FLOAT32_MAX
    if x <= -_FLOAT32_MAX:
        return -math.inf
    f = struct.unpack("<f", struct.pack("<f", x))[0]  # round to nearest float32
    if f > x:  # rounded up: step down one float32 ulp
        bits = struct.unpack("<i", struct.pack("<f", f))[0]
        bits = bits - 1 if f > 0 else (bits + 1 if f < 0 else -(2**31) + 1)  # f == 0 -> -smallest subnormal
        f = struct.unpack("<f", struct.pack("<i", bits))[0]
    return f


def _float32_ceil(x: float) -> float:
    """Smallest float32 value >= x (for a float32 y: y < x <=> y < _float32_ceil(x))."""
    return -_float32_floor(-x)


def _in_host_memory(device: torch.device, host_memory: bool | None) -> bool:
    """Whether tensors on ``device`` are read as host memory (reading is free and ``nonzero`` needs no sync), or as
    accelerator memory (sizes travel with the single sync and ``nonzero_static`` is used). ``host_memory`` overrides
    the device's answer (see the module docstring)."""
    return device.type == "cpu" if host_memory is None else bool(host_memory)


def _scalar(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    # torch.full launches a fill with a host scalar: no device->host sync (unlike reading a tensor) and no
    # pageable host->device copy (unlike torch.tensor(value, device=...)).
    return torch.full((), value, dtype=dtype, device=device)


def _host_vector(values: list, device: torch.device) -> Tensor:
    """A float64 vector of host numbers on ``device`` without a device sync: on an accelerator it is copied from
    pinned memory asynchronously (a copy from pageable memory would wait for the stream)."""
    if device.type == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.float64))
    vec = torch.tensor(values, dtype=torch.float64)
    if torch.cuda.is_available():
        vec = vec.pin_memory()
    return vec.to(device, non_blocking=True)


def _rank_desc_then_index(values: Tensor, flat_index: Tensor) -> Tensor:
    """Permutation ordering ``values`` (float32, >= 0 or +inf) by value descending, then flat index ascending.

    One sort of unique int64 keys: for float32 values >= 0 the bit pattern is monotone in the value (+inf
    included), so high word = 2^31 - 1 - bits, low word = flat index (< 2^32).  Unique keys make the order
    fully determined without a stable sort, and integer sorts are radix sorts (much faster on CPU).
    """
    bits = values.view(torch.int32).to(torch.int64)
    return torch.sort(((2**31 - 1 - bits) << 32) | flat_index).indices


@functools.cache
def _exp_safe_max(dtype: torch.dtype) -> float:
    """delta below this bound means exp(delta) cannot overflow in ``dtype`` (float32/bf16: delta < 87.7)."""
    if not dtype.is_floating_point:
        return 0.0
    return math.log(torch.finfo(dtype).max) - 1.0


def _check_rule(rule: str) -> None:
    if rule not in M2PO_RULES:
        raise ValueError(f"rule={rule!r} is unknown; use one of {list(M2PO_RULES)}.")


def _check_floors(rule: str, clip_floor_low: float | None, clip_floor_high: float | None) -> None:
    if (clip_floor_low is not None or clip_floor_high is not None) and rule != "authors_code":
        raise ValueError("clip_floor_low / clip_floor_high apply to rule='authors_code' only.")
    if clip_floor_low is not None and not 0.0 <= clip_floor_low < 1.0:
        raise ValueError(f"clip_floor_low must be in [0, 1), got {clip_floor_low!r}.")
    if clip_floor_high is not None and not clip_floor_high >= 0.0:
        raise ValueError(f"clip_floor_high must be >= 0, got {clip_floor_high!r}.")


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1 and like.dim() >= 2:
        advantages = advantages.unsqueeze(1)  # (B,) -> (B, 1), as TRL does
    return advantages


# --------------------------------------------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------------------------------------------


def _named_from_sums(s: list) -> list:
    valid, kept, tr, kept_tr, d2, d2_kept, d2_tr, d2_kept_tr, _ = s
    return [
        (valid - kept) / valid if valid else 0.0,
        d2 / valid if valid else 0.0,
        d2_kept / kept if kept else 0.0,
        tr / valid if valid else 0.0,
        d2_tr / tr if tr else 0.0,
        d2_kept_tr / kept_tr if kept_tr else 0.0,
    ]


class M2POStats(Mapping):
    """The detached stats of one selection.  ``sums`` (a float64 vector of ``M2PO_SUM_KEYS``) is what is stored; the
    ``M2PO_STAT_KEYS`` (0-dim float64) and ``all_masked`` (0-dim bool) are derived from it when first read (device
    ops, no sync), so a caller that only accumulates ``sums`` pays nothing for them."""

    __slots__ = ("_extra", "_named", "sums")

    def __init__(self, sums: Tensor, extra: dict | None = None):
        self.sums = sums
        self._extra = extra or {}
        self._named = None

    def __getitem__(self, key):
        if key == "sums":
            return self.sums
        if key == "all_masked":
            return self.sums[-1] > 0
        if key in self._extra:
            return self._extra[key]
        if key not in M2PO_STAT_KEYS:
            raise KeyError(key)
        if self._named is None:
            self._named = _named_from_device_sums(self.sums).unbind()
        return self._named[M2PO_STAT_KEYS.index(key)]

    def __iter__(self):
        return iter((*M2PO_STAT_KEYS, "all_masked", "sums", *self._extra))

    def __len__(self):
        return len(M2PO_STAT_KEYS) + 2 + len(self._extra)

    def __repr__(self):
        return f"M2POStats({dict(self)!r})"


def _named_from_device_sums(sums: Tensor) -> Tensor:
    valid, kept, tr, kept_tr, d2, d2_kept, d2_tr, d2_kept_tr, _ = sums.unbind()

    def ratio(num, den):
        return torch.where(den > 0, num / den.clamp(min=1.0), 0.0)

    return torch.stack(
        [
            ratio(valid - kept, valid),
            ratio(d2, valid),
            ratio(d2_kept, kept),
            ratio(tr, valid),
            ratio(d2_tr, tr),
            ratio(d2_kept_tr, kept_tr),
        ]
    )


def _stats_from_host(sums: list, device: torch.device, extra: dict | None = None) -> M2POStats:
    """Stats from host numbers (one small host-to-device copy at most, no sync)."""
    return M2POStats(_host_vector(sums, device), extra)


def _stats_from_device(sums: Tensor, extra: dict | None = None) -> M2POStats:
    """Stats from a float64 device vector of ``M2PO_SUM_KEYS`` (no sync)."""
    return M2POStats(sums, extra)


def _empty_sums() -> list:
    return [0.0] * len(M2PO_SUM_KEYS)


def _device_sums(tok: _Tokens, keep: Tensor) -> Tensor:
    """``M2PO_SUM_KEYS`` reduced on the device from a finished selection (no sync)."""
    d2, valid = tok.d2, tok.valid  # d2 is 0 on padding
    n_valid, n_kept = valid.sum(), keep.sum()
    counts = [n_valid, n_kept]
    d2_sums = [d2.sum(dtype=torch.float64), torch.where(keep, d2, 0.0).sum(dtype=torch.float64)]
    trust = tok.trust
    if trust is None:
        zero = torch.zeros((), dtype=torch.float64, device=d2.device)
        counts += [zero, zero]
        d2_sums += [zero, zero]
    else:
        kept_tr = trust & keep
        counts += [trust.sum(), kept_tr.sum()]
        d2_sums += [
            torch.where(trust, d2, 0.0).sum(dtype=torch.float64),
            torch.where(kept_tr, d2, 0.0).sum(dtype=torch.float64),
        ]
    all_masked = (n_valid > 0) & (n_kept == 0)  # valid tokens, none of them carrying gradient
    return torch.stack([c.to(torch.float64) for c in counts] + d2_sums + [all_masked.to(torch.float64)])


def m2po_metrics(sums: Tensor | Sequence[float]) -> dict:
    """Logged M2PO figures from ``M2PO_SUM_KEYS`` summed over micro-batches (and ranks).

    Returns floats: the ``M2PO_STAT_KEYS`` (token-weighted over everything summed, not a mean of per-batch
    fractions) and ``all_masked_batches``, a count.
    """
    s = [float(x) for x in (sums.tolist() if isinstance(sums, Tensor) else sums)]
    out = dict(zip(M2PO_STAT_KEYS, _named_from_sums(s), strict=True))
    out["all_masked_batches"] = s[-1]
    return out


# --------------------------------------------------------------------------------------------------------------
# selection: shared pieces
# --------------------------------------------------------------------------------------------------------------


class _Tokens:
    """The detached per-token quantities a selection works on, each computed once.

    delta: the log ratio in float32 (every position); valid: bool mask; dv: delta on valid tokens, 0 on padding
    (whatever padding holds never leaks); r: |delta| on trust-region tokens, 0 elsewhere (None without advantages):
    r = max(sign(A) * dv, 0), which is > 0 exactly when (A > 0 and delta > 0) or (A < 0 and delta < 0) -- multiplying
    by +-1 or 0 never rounds.  It is NaN where delta is NaN or infinite with A = 0: such a token makes every bound
    unverifiable.  (A NaN advantage has sign 0 in torch: not a trust-region token.)  d2 = dv^2 and trust = r > 0
    are derived when first needed.
    """

    __slots__ = ("_d2", "_trust", "delta", "dv", "owned", "r", "valid")

    def __init__(self, delta, valid, dv, r, owned=False):
        self.delta, self.valid, self.dv, self.r = delta, valid, dv, r
        self.owned = owned  # valid is a fresh tensor (not the caller's mask, not an expanded view): may be returned
        self._d2 = self._trust = None

    @property
    def d2(self) -> Tensor:
        if self._d2 is None:
            self._d2 = self.dv.square()
        return self._d2

    @property
    def trust(self) -> Tensor | None:
        if self._trust is None and self.r is not None:
            self._trust = self.r > 0
        return self._trust


def _prepare(log_ratio: Tensor, mask: Tensor, advantages: Tensor | None, rule: str) -> _Tokens:
    device, shape = log_ratio.device, log_ratio.shape
    valid = mask.to(device=device, dtype=torch.bool)
    owned = valid is not mask
    if valid.shape != shape:
        valid, owned = valid.expand(shape), False
    delta = log_ratio.detach()
    if delta.dtype != torch.float32:
        delta = delta.float()  # delta^2 is ranked in float32
    dv = torch.where(valid, delta, 0.0)
    if advantages is None:
        if rule != "all_tokens":
            raise ValueError(f"rule={rule!r} needs the advantages (its candidates are the trust-region tokens).")
        return _Tokens(delta, valid, dv, None, owned)
    sign = _broadcast_advantages(advantages.detach().to(device), delta).sign()
    return _Tokens(delta, valid, dv, torch.mul(dv, sign).clamp_(min=0.0), owned)


def _empty_selection(shape, device, ratios_finite=False, extra=None) -> M2POSelection:
    keep = torch.zeros(shape, dtype=torch.bool, device=device)
    stats = _stats_from_host(_empty_sums(), device, extra)
    return M2POSelection(keep, stats, n_valid=0, ratios_finite=ratios_finite)


def _nan_selection(tok: _Tokens, n_valid, ratios_finite, extra=None) -> M2POSelection:
    """A NaN on a valid token: no bound can be verified, so nothing is kept (and it is flagged)."""
    keep = torch.zeros_like(tok.valid)
    stats = _stats_from_device(_device_sums(tok, keep), extra)
    return M2POSelection(keep, stats, n_valid=n_valid, ratios_finite=ratios_finite)


def _drop_count(sorted_vals: Tensor, n_cand: int, small_sum: Tensor | float, tau: float, rule: str):
    """Rules "paper" / "all_tokens" on candidates given as their delta^2 > tau, sorted descending.

    ``n_cand`` counts all candidates, ``small_sum`` is the delta^2 sum of those not in ``sorted_vals``.  For k in
    [0, c] (c = len(sorted_vals)), rem_k = small_sum + sum(sorted_vals[k:]), and k* is the first k with
    rem_k <= tau * (n_cand - k) -- for "all_tokens" also n_cand - k > 0.  Returns (k*, found, rem) on the device.
    """
    c = sorted_vals.numel()
    device = sorted_vals.device
    suffix = sorted_vals.to(torch.float64).flip(0).cumsum(0).flip(0)  # suffix[k] = sum of sorted_vals[k:]
    rem = torch.cat([suffix, suffix.new_zeros(1)]) + small_sum  # rem_k, k = 0..c; sums of non-negative terms
    kk = torch.arange(c + 1, dtype=torch.float64, device=device)
    cond = rem <= tau * (n_cand - kk)
    if rule == "all_tokens":
        cond &= (n_cand - kk) > 0
    else:
        # Algorithm 1 stops at the latest when T is empty; the candidates left then (delta^2 <= tau) have mean
        # <= tau in exact arithmetic, so k = c always qualifies (float64 rounding must not say otherwise).
        cond[-1] = True
    found = cond.any()
    k_star = torch.argmax(cond.to(torch.uint8))
    return k_star, found, rem


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
    return torch.where(k_star > 0, v[(k_star - 1).clamp(min=0)], 0.0)


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


# --------------------------------------------------------------------------------------------------------------
# selection: one tensor (micro-batch scope)
# --------------------------------------------------------------------------------------------------------------


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
        rule: ``"paper"``, ``"all_tokens"`` or ``"authors_code"`` (see the module docstring).
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
        dropped_sum = rem[0] - rem[k_star_t]
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
                rem[k_star_t],
                (k_f == n_valid).to(torch.float64),
            ]
        )
    else:
        sums = _device_sums(tok, keep)
    return M2POSelection(keep, _stats_from_device(sums), n_valid=n_valid, ratios_finite=ratios_finite)


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
# selection: the whole optimizer batch across data-parallel ranks (global scope)
# --------------------------------------------------------------------------------------------------------------


def _flatten_batches(log_ratio, mask, advantages):
    """A list of micro-batches -> one flat tensor each (advantages broadcast to tokens first), and their shapes."""
    if isinstance(log_ratio, Tensor):
        return log_ratio, mask, advantages, None
    shapes = [lr.shape for lr in log_ratio]
    flat_lr = torch.cat([lr.detach().reshape(-1) for lr in log_ratio])
    flat_mask = torch.cat(
        [
            m.to(device=lr.device, dtype=torch.bool).expand(lr.shape).reshape(-1)
            for m, lr in zip(mask, log_ratio, strict=True)
        ]
    )
    flat_adv = None
    if advantages is not None:
        flat_adv = torch.cat(
            [
                _broadcast_advantages(a.detach().to(lr.device), lr).expand(lr.shape).reshape(-1)
                for a, lr in zip(advantages, log_ratio, strict=True)
            ]
        )
    return flat_lr, flat_mask, flat_adv, shapes


def m2po_select_global(
    log_ratio: Tensor | Sequence[Tensor],
    mask: Tensor | Sequence[Tensor],
    threshold: float = 0.04,
    advantages: Tensor | Sequence[Tensor] | None = None,
    rule: str = "paper",
    *,
    group=None,
    clip_floor_low: float | None = None,
    clip_floor_high: float | None = None,
    host_memory: bool | None = None,
) -> M2POSelection | list:
    """:func:`m2po_select` over the whole optimizer batch of every rank in ``group`` (the ms-swift / Trinity scope).

    Each rank passes its own tokens: one tensor, or a list of micro-batches (then a list of selections, one per
    micro-batch, comes back).  The answer equals :func:`m2po_select` on the concatenation of every rank's flattened
    tokens in rank order (micro-batches in list order, row-major inside each): ties between ranks go to the lower
    rank first.  ``group`` is a ``torch.distributed`` process group of the data-parallel ranks (default: the world);
    without an initialised process group (or with one rank) this is :func:`m2po_select` itself.

    Communication: two ``all_gather`` calls per call -- a fixed-size header (counts and sums) and then the delta^2
    of the tokens that may be masked ("paper" / "all_tokens": the candidates above tau, by the lemma; "authors_code":
    the harmful tokens), padded to the largest rank's count.  One host sync (reading the header, which sizes the
    second gather).  Every rank then takes the same decision on the same gathered values.

    The stats of each returned selection are local (that micro-batch's tokens): sum their ``sums`` across ranks
    for the global figures.
    """
    import torch.distributed as dist

    _check_rule(rule)
    _check_floors(rule, clip_floor_low, clip_floor_high)
    tau = float(threshold)
    if not tau >= 0.0:
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    flat_lr, flat_mask, flat_adv, shapes = _flatten_batches(log_ratio, mask, advantages)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        sel = m2po_select(flat_lr, flat_mask, tau, flat_adv, rule, clip_floor_low=clip_floor_low,
                          clip_floor_high=clip_floor_high, host_memory=host_memory)  # fmt: skip
        return sel if shapes is None else _split_selection(sel, _prepare(flat_lr, flat_mask, flat_adv, rule), shapes)
    tok = _prepare(flat_lr, flat_mask, flat_adv, rule)
    on_host = _in_host_memory(flat_lr.device, host_memory)
    gathered = _gather_global_candidates(tok, tau, rule, group, on_host)
    sel = _decide_global(tok, gathered, tau, rule, clip_floor_low, clip_floor_high)
    return sel if shapes is None else _split_selection(sel, tok, shapes)


@dataclasses.dataclass
class _GlobalCandidates:
    """Every rank's candidates, gathered: the same on every rank, but `sent_idx` and `offset` (this rank's)."""

    values: Tensor  # the delta^2 sent by every rank, in global order (rank, then local flat index)
    sent_idx: Tensor  # this rank's flat indices of what it sent
    offset: int  # where this rank's values start in `values`
    n_cand: int  # candidates on every rank
    small_sum: float  # delta^2 sum of the candidates not sent (below tau)
    sent_sum: float  # delta^2 sum of those sent
    nan_anywhere: bool  # a NaN on a valid token of some rank


def _gather_global_candidates(tok: _Tokens, tau: float, rule: str, group, on_host: bool) -> _GlobalCandidates:
    """The two all_gathers: each rank's header (counts and sums), then the tokens it may mask (the candidates above
    tau for "paper" / "all_tokens", by the lemma; every harmful token for "authors_code", whose cut may fall below
    tau), in local flat order, padded to the largest rank's count."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    valid_flat = tok.valid.reshape(-1)
    # Candidates and their delta^2 (key, 0 elsewhere): trust-region tokens, or every valid token for "all_tokens".
    if rule == "all_tokens":
        cand, key = valid_flat, tok.d2.reshape(-1)
    else:
        cand, key = tok.trust.reshape(-1), tok.r.square().reshape(-1)
    sent = cand if rule == "authors_code" else key > _float32_floor(tau)
    dv_flat = tok.dv.reshape(-1)
    header = torch.stack(
        [
            cand.sum().double(),
            sent.sum().double(),
            torch.where(sent, 0.0, key).sum(dtype=torch.float64),  # candidates not sent
            torch.where(sent, key, 0.0).sum(dtype=torch.float64),
            torch.dot(dv_flat, dv_flat).double() + key.sum(dtype=torch.float64),  # NaN: a NaN on a valid token
        ]
    )
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    h = torch.stack(headers).tolist()  # the host sync
    counts = [int(r[1]) for r in h]
    nan_anywhere = any(math.isnan(r[4]) for r in h)
    n_sent = counts[rank]
    if on_host:
        sent_idx = sent.nonzero().squeeze(1)
    else:
        sent_idx = torch.nonzero_static(sent, size=n_sent).squeeze(1)
    width = max(counts)
    values = key.new_zeros(0)
    if width > 0 and not nan_anywhere:
        payload = key.new_zeros(width)
        payload[:n_sent] = key[sent_idx]
        buffers = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(buffers, payload, group=group)
        values = torch.cat([b[:n] for b, n in zip(buffers, counts, strict=True)])  # global order
    return _GlobalCandidates(
        values=values,
        sent_idx=sent_idx,
        offset=sum(counts[:rank]),
        n_cand=int(sum(r[0] for r in h)),
        small_sum=sum(r[2] for r in h),
        sent_sum=sum(r[3] for r in h),
        nan_anywhere=nan_anywhere,
    )


def _decide_global(tok: _Tokens, g: _GlobalCandidates, tau, rule, clip_floor_low, clip_floor_high) -> M2POSelection:
    """The same decision on every rank, from the gathered candidates; this rank's part of it."""
    valid_flat = tok.valid.reshape(-1)
    device, shape = valid_flat.device, tok.valid.shape
    clipped = low = high = None
    extra = {"clip_log_bound": _scalar(math.inf, device)} if rule == "authors_code" else None
    if g.nan_anywhere:  # no bound can be verified anywhere: nothing is kept on any rank
        keep = torch.zeros_like(valid_flat)
    elif rule == "authors_code":
        keep = valid_flat.clone()
        if g.n_cand and g.sent_sum / g.n_cand > tau + _AUTHORS_EPS:
            cut2 = _authors_cut(torch.sort(g.values).values, tau)
            clipped, low, high = _authors_clipped(tok, cut2, clip_floor_low, clip_floor_high)
            clipped = clipped.reshape(-1)
            keep &= ~clipped
            extra = {"clip_log_bound": cut2.sqrt().float()}
    else:
        total, n_sent = g.values.numel(), g.sent_idx.numel()
        order = _rank_desc_then_index(g.values, torch.arange(total, device=device))
        k_star, found, _ = _drop_count(g.values[order], g.n_cand, g.small_sum, tau, rule)
        keep_global = torch.empty(total, dtype=torch.bool, device=device)
        keep_global[order] = torch.arange(total, device=device) >= k_star  # global ranks < k* are masked
        keep = valid_flat.clone()
        keep[g.sent_idx] = keep_global[g.offset : g.offset + n_sent]
        keep &= found  # "all_tokens" with no admissible k: nothing kept on any rank
    return M2POSelection(
        keep.view(shape),
        _stats_from_device(_device_sums(tok, keep.view(shape)), extra),
        None if clipped is None else clipped.view(shape),
        low,
        high,
    )


def _split_selection(sel: M2POSelection, tok: _Tokens, shapes) -> list:
    """One selection over a flat concatenation -> one per micro-batch (local stats each)."""
    numels = [math.prod(s) for s in shapes]
    extra = {"clip_log_bound": sel.stats["clip_log_bound"]} if "clip_log_bound" in sel.stats else None

    def parts(t):
        return t.reshape(-1).split(numels) if t is not None else [None] * len(shapes)

    out = []
    for shape, k, v, dlt, dv, r, cl in zip(
        shapes,
        parts(sel.keep),
        parts(tok.valid),
        parts(tok.delta),
        parts(tok.dv),
        parts(tok.r),
        parts(sel.clipped),
        strict=True,
    ):
        piece = _Tokens(dlt, v, dv, r)
        stats = _stats_from_device(_device_sums(piece, k), extra)
        cl = None if cl is None else cl.view(shape)
        out.append(M2POSelection(k.view(shape), stats, cl, sel.clip_log_low, sel.clip_log_high))
    return out


# --------------------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------------------


def m2po_loss(
    per_token_logps: Tensor,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    threshold: float = 0.04,
    normalizer: Tensor | float | None = None,
    *,
    rule: str = "paper",
    selection: M2POSelection | None = None,
    clip_floor_low: float | None = None,
    clip_floor_high: float | None = None,
    host_memory: bool | None = None,
) -> tuple[Tensor, dict]:
    """M2PO loss (Zheng et al. 2025, arXiv:2510.01161).

    ``delta_t = per_token_logps - behaviour_logps``, ``r_t = exp(delta_t)``, selection by ``rule`` (see
    :func:`m2po_select`), then:

    * ``"paper"`` / ``"all_tokens"``: ``J = (1/N) sum_t M_t r_t A_t`` (no epsilon-clip), ``loss = -J``.
    * ``"authors_code"``: ``J = (1/N) sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)`` over valid tokens, with the clip
      bounds of the selection (none when the budget holds).  Only harmful tokens can be held at a bound; they add
      ``A_t * bound`` without gradient.  The authors average per micro-batch ("token-mean"); pass ``normalizer`` to
      match (the default, the number of valid tokens, does).

    The gradient flows through ``r_t`` of the kept tokens: ``d loss / d per_token_logps_t = -M_t r_t A_t / N``.

    Args:
        per_token_logps: ``log pi_theta``, shape ``(B, T)``, requires grad.
        behaviour_logps: ``log mu`` of the policy that sampled the tokens, same shape.
        advantages: ``(B,)`` (unsqueezed to ``(B, 1)``) or ``(B, T)``.
        mask: valid-token mask, ``(B, T)``.
        threshold: ``tau_M2`` (0.04 in the paper).
        normalizer: N.  The trainer passes TRL ``dapo``'s normaliser.  Default: the number of valid tokens
            before masking, clamped to >= 1.  A non-positive tensor normaliser is replaced by 1 (there is then
            nothing to normalise); a non-positive number raises ``ValueError``.
        rule: ``"paper"`` (default), ``"all_tokens"`` or ``"authors_code"``.
        selection: a selection already made for these tokens (e.g. one micro-batch's part of
            :func:`m2po_select_global`); then ``threshold``, ``rule`` and the floors are not used.
        clip_floor_low, clip_floor_high: ``"authors_code"`` only (see :func:`m2po_select`).
        host_memory: see :func:`m2po_select` (when it selects here).

    Returns:
        ``(loss, stats)``; ``stats`` are the selection's (see :class:`M2POSelection`), detached, no host sync spent
        on them.  When ``all_masked`` the loss is an exact zero that still has a graph (backward gives zero
        gradients); the caller should warn and count it.

    Masked tokens and padding enter neither the value nor the gradient (weight exactly 0).  When some ratio is
    not finite (inf/NaN log-probs, or exp overflow), their ``delta`` is replaced by ``-inf`` before the ``exp``
    instead, so inf * 0 = NaN cannot leak in.  Low-precision log-probs (bf16/fp16) are accumulated in the
    advantages' dtype (float32), as TRL does.
    """
    delta = per_token_logps - behaviour_logps
    adv = _broadcast_advantages(advantages.detach(), delta)
    if selection is None:
        selection = m2po_select(
            delta, mask, threshold, adv, rule, clip_floor_low=clip_floor_low, clip_floor_high=clip_floor_high,
            host_memory=host_memory,
        )  # fmt: skip
        ratios_finite = selection.ratios_finite
    else:
        if selection.keep.shape != delta.shape:
            raise ValueError(
                f"selection is for shape {tuple(selection.keep.shape)}, the loss has {tuple(delta.shape)}"
            )
        ratios_finite = False  # decided on other (pre-pass) values: always guard
    keep = selection.keep

    if selection.clipped is not None:
        # "authors_code" with a binding clip: a clipped token's term is A * bound, a constant (PPO's clip).
        bound = torch.where(delta.detach() > 0, selection.clip_log_high, selection.clip_log_low)
        effective = torch.where(selection.clipped, bound.to(delta.dtype), delta)
        objective_sum = (torch.exp(torch.where(keep | selection.clipped, effective, float("-inf"))) * adv).sum()
    elif ratios_finite:
        # Every exp(delta) is finite (checked in the selection's single sync), so the mask can ride on the
        # advantages: weight 0 on masked tokens and padding, zero value and zero gradient there.
        objective_sum = (torch.exp(delta) * (keep * adv)).sum()
    else:
        # Some ratio is inf/NaN (or would overflow): replace delta by -inf wherever the mask is off, so the
        # ratio there is exactly 0 and inf * 0 = NaN cannot leak into the value or the gradient.
        objective_sum = (torch.exp(torch.where(keep, delta, float("-inf"))) * adv).sum()

    if normalizer is None:
        if selection.n_valid is not None:
            loss = objective_sum * (-1.0 / max(selection.n_valid, 1))
        else:
            valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)
            loss = -objective_sum / valid.sum().clamp(min=1).to(objective_sum.dtype)
    elif isinstance(normalizer, Tensor):
        denom = torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer)).to(objective_sum.dtype)
        loss = -objective_sum / denom
    else:
        if not float(normalizer) > 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer!r}")
        loss = objective_sum * (-1.0 / float(normalizer))
    return loss, selection.stats


def m2po_mask_reference(log_ratio: Tensor, mask: Tensor, advantages: Tensor, threshold: float = 0.04) -> Tensor:
    """Algorithm 1 of Zheng et al. 2025 (the ``"paper"`` rule), one token at a time: :func:`m2po_select` to read.

        T <- {t valid : (A_t > 0 and delta_t > 0) or (A_t < 0 and delta_t < 0)}          (the trust-region tokens)
        while T is not empty and mean_{t in T} delta_t^2 > tau:
            remove from T the token with the largest delta_t^2 (ties: the lower flat index first)
        M_t = 0 for the removed tokens, 1 for every other valid token (padding: 0)

    O(n^2) in the worst case and one host read per token: for reading beside the vectorized path, and for testing it.
    delta^2 is ranked in float32 and the means are taken in float64, as in :func:`m2po_select`, so the two agree on
    finite inputs (``tests/test_m2po_reference.py``).
    """
    delta = log_ratio.detach().float().reshape(-1).tolist()
    valid = mask.to(torch.bool).expand(log_ratio.shape).reshape(-1).tolist()
    adv = _broadcast_advantages(advantages.detach().float(), log_ratio).expand(log_ratio.shape).reshape(-1).tolist()
    d2 = log_ratio.detach().float().square().reshape(-1).tolist()  # float32 squares, as the ranking uses
    trust = [
        i for i, ok in enumerate(valid) if ok and ((adv[i] > 0 and delta[i] > 0) or (adv[i] < 0 and delta[i] < 0))
    ]
    keep = list(valid)
    remaining = sorted(trust, key=lambda i: (-d2[i], i))  # removal order: largest delta^2 first, lower index first
    total = math.fsum(d2[i] for i in remaining)
    while remaining and total / len(remaining) > threshold:
        dropped = remaining.pop(0)
        keep[dropped] = False
        total = math.fsum(d2[i] for i in remaining)
    return torch.tensor(keep, dtype=torch.bool, device=log_ratio.device).view(log_ratio.shape)
