"""What every selection path shares: its result, the per-token quantities it works on, and the count k* to mask.

* :class:`M2POSelection`, what every rule returns: which tokens keep their gradient, and the stats.
* ``_Tokens`` / ``_prepare``: delta, the valid mask and the trust-region magnitudes, computed once per call.
* ``_drop_count``: rules "paper" / "all_tokens" on sorted candidates -- the k* largest delta^2 to mask (used by
  ``fast.py`` and ``global_scope.py``).
* float32-exact comparisons (``_float32_floor``): delta^2 is ranked in float32 while tau is a Python float, and
  comparing a float32 tensor against ``_float32_floor(tau)`` decides ``delta^2 > tau`` exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct

import torch
from torch import Tensor

from .stats import M2POStats, _empty_sums, _stats_from_device, _stats_from_host

M2PO_RULES = ("paper", "all_tokens", "authors_code")
M2PO_SCOPES = ("micro_batch", "global")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    the device's answer (see ``fast.py``'s docstring)."""
    return device.type == "cpu" if host_memory is None else bool(host_memory)


def _scalar(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    # torch.full launches a fill with a host scalar: no device->host sync (unlike reading a tensor) and no
    # pageable host->device copy (unlike torch.tensor(value, device=...)).
    return torch.full((), value, dtype=dtype, device=device)


def _at(values: Tensor, index: Tensor) -> Tensor:
    """``values[index]`` for a 0-dim integer tensor ``index``, on the device.  Python indexing with a 0-dim tensor
    reads it on the host first (``item()``: a device sync); ``gather`` does not."""
    return values.gather(0, index.reshape(1)).squeeze(0)


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
# the tokens a selection works on
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
    # The sign in float32 too: a float64 advantage would promote r (and every delta^2 ranked from it) to float64.
    sign = _broadcast_advantages(advantages.detach().to(device=device, dtype=torch.float32), delta).sign()
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


# --------------------------------------------------------------------------------------------------------------
# rules "paper" / "all_tokens": how many of the largest delta^2 to mask
# --------------------------------------------------------------------------------------------------------------


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
        # (Not `cond[-1] = True`: assigning a number to one element copies it from the host, a device sync.)
        cond |= kk == c
    found = cond.any()
    k_star = torch.argmax(cond.to(torch.uint8))
    return k_star, found, rem


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
