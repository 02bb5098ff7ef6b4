"""What a selection reports: per-call sums that add up across micro-batches and ranks, and the logged figures.

Every selection returns :class:`M2POStats`, a read-only mapping over one float64 vector ``sums`` of the
``M2PO_SUM_KEYS``.  A trainer adds the ``sums`` of its micro-batches (and ranks) and calls :func:`m2po_metrics` once
per log; the ``M2PO_STAT_KEYS`` figures of a single call are derived from its ``sums`` when first read.  docs/m2po.md
("Metrics") defines each figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

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


def m2po_metrics(sums: Tensor | Sequence[float]) -> dict:
    """Logged M2PO figures from ``M2PO_SUM_KEYS`` summed over micro-batches (and ranks).

    Returns floats: the ``M2PO_STAT_KEYS`` (token-weighted over everything summed, not a mean of per-batch
    fractions) and ``all_masked_batches``, a count.
    """
    s = [float(x) for x in (sums.tolist() if isinstance(sums, Tensor) else sums)]
    out = dict(zip(M2PO_STAT_KEYS, _named_from_sums(s), strict=True))
    out["all_masked_batches"] = s[-1]
    return out


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


def _host_vector(values: list, device: torch.device) -> Tensor:
    """A float64 vector of host numbers on ``device`` without a device sync: on an accelerator it is copied from
    pinned memory asynchronously (a copy from pageable memory would wait for the stream).  On a CPU the move is a
    no-op, written the same way so that the sync counter (``tests/support/host_syncs.py``) sees the same code."""
    vec = torch.from_numpy(np.array(values, dtype=np.float64))
    if device.type == "cuda":
        vec = vec.pin_memory()
    return vec.to(device, non_blocking=True)


def _stats_from_host(sums: list, device: torch.device, extra: dict | None = None) -> M2POStats:
    """Stats from host numbers (one small host-to-device copy at most, no sync)."""
    return M2POStats(_host_vector(sums, device), extra)


def _stats_from_device(sums: Tensor, extra: dict | None = None) -> M2POStats:
    """Stats from a float64 device vector of ``M2PO_SUM_KEYS`` (no sync)."""
    return M2POStats(sums, extra)


def _empty_sums() -> list:
    return [0.0] * len(M2PO_SUM_KEYS)
