"""Selection scope ``"global"``: :func:`m2po_select_global`, one selection over every rank's optimizer batch.

The rule is not linear in the batch (selecting over two halves gives another mask than selecting over the whole), so
where the tokens are pooled is part of the algorithm.  The ms-swift (PR #9965) and Trinity-RFT (PR #616) M2PO select
over the whole optimizer batch across the data-parallel ranks; this gives the same answer as :func:`m2po_select`
(``fast.py``) on the concatenation of every rank's tokens, with two ``all_gather`` calls and one host sync.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .authors_code import _AUTHORS_EPS, _authors_clipped, _authors_cut
from .fast import m2po_select
from .selection import (
    M2POSelection,
    _broadcast_advantages,
    _check_floors,
    _check_rule,
    _device_sums,
    _drop_count,
    _float32_floor,
    _in_host_memory,
    _prepare,
    _rank_desc_then_index,
    _scalar,
    _Tokens,
)
from .stats import _stats_from_device


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
