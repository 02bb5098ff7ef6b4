"""Off-policy diagnostics: how far the rows entering a loss are from the policy being trained (`offpolicy/*`).

Every asynchronous row was sampled by a behaviour policy μ (the weights version that generated it, under the processed
sampling distribution) and enters the loss of a newer policy π. Per valid completion token t:

    δ_t = log π(y_t | ·) − log μ(y_t | ·),        w_t = exp(δ_t)   (the per-token importance weight π/μ)

π is the policy at the start of the optimizer step (TRL's π_old: the loss's own forward, detached, or TRL's
`old_per_token_logps` when a batch spans several steps); for M2PO it is π_θ of the loss itself, the ratio M2PO bounds.

Logged over each logging window, token-weighted over every rank (sums are accumulated, ratios taken when logged):

* `offpolicy/ess`, `offpolicy/ess_min`: the normalized effective sample size of the per-token weights of one batch
  (one loss call on one rank), ESS = (Σ w)² / (N Σ w²) ∈ (0, 1] (Kong 1992; 1 when π = μ), averaged over the window's
  batches and ranks, and its minimum.
* `offpolicy/delta_sq_before`: E[δ²] over valid tokens; `offpolicy/delta_sq_after`: E[δ'²] over the tokens that keep a
  non-zero weight after the loss's off-policy treatment, δ' the log of the weight actually applied (clipped values
  for truncation, the M2PO mask, TRL's mask modes). M2PO's bound is on this second moment (Zheng et al. 2025, §3).
* `offpolicy/masked_fraction` (tokens given weight 0: M2PO's mask, TRL's mask modes), `offpolicy/clipped_fraction`
  (tokens whose weight was clamped: TRL's truncate modes, M2PO `authors_code`'s clip), and
  `offpolicy/sequence_masked_fraction` (rows masked whole: TRL's `sequence_mask`).
* `offpolicy/row_age_min`, `_mean`, `_max`: the age of each row when it enters a loss (the trainer's version minus the
  version of its oldest token), counted per loss entry; trackers that take histograms (TensorBoard, W&B, Trackio) also
  get the window's histogram as `offpolicy/row_age`. `offpolicy/token_age_mean` is the mean age of the completion
  tokens themselves: with in-flight weight updates later tokens come from newer weights, without them every token
  has its row's age.

Pure tensor functions (no model, no trainer); `tests/test_offpolicy.py` checks them against loops written by hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .importance import weights_on_a_bound

OFFPOLICY_SUM_KEYS = (
    "tokens",  # valid tokens
    "delta_sq",  # Σ δ² over valid tokens
    "kept_tokens",  # valid tokens with a non-zero weight after the treatment
    "delta_sq_kept",  # Σ δ'² over those
    "masked_tokens",  # valid tokens given weight 0
    "clipped_tokens",  # valid tokens whose weight was clamped
    "rows",  # rows with at least one valid token
    "masked_rows",  # of those, rows masked whole
    "weight_sum",  # Σ w over valid tokens
    "weight_sq_sum",  # Σ w² over valid tokens
)
# exp(±300) and its square stay finite in float64 (max ~1.8e308): a weight that large is off the scale anyway.
_LOG_WEIGHT_CAP = 300.0


def offpolicy_sums(
    delta: Tensor,
    mask: Tensor,
    *,
    kept: Tensor | None = None,
    delta_after: Tensor | None = None,
    clipped: Tensor | None = None,
    masked_rows: Tensor | None = None,
) -> Tensor:
    """The `OFFPOLICY_SUM_KEYS` of one batch, a float64 vector (no host sync).

    Args:
        delta: (B, T) log π − log μ (detached by the caller or here).
        mask: (B, T) valid tokens.
        kept: (B, T) tokens whose weight is non-zero after the off-policy treatment (default: every valid token).
        delta_after: (B, T) log of the weight applied to each kept token (default: `delta`, no clipping).
        clipped: (B, T) tokens whose weight was clamped to a bound (default: none).
        masked_rows: (B,) rows masked whole (default: none).
    """
    delta = delta.detach().to(torch.float64)
    valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)
    delta = torch.where(valid, torch.nan_to_num(delta, nan=0.0), 0.0)
    kept = valid if kept is None else kept.to(device=delta.device, dtype=torch.bool).expand(delta.shape) & valid
    after = delta if delta_after is None else torch.where(valid, delta_after.detach().to(torch.float64), 0.0)
    after = torch.nan_to_num(after, nan=0.0, posinf=_LOG_WEIGHT_CAP, neginf=-_LOG_WEIGHT_CAP)
    clipped = torch.zeros_like(valid) if clipped is None else clipped.to(device=delta.device, dtype=torch.bool) & valid
    row_valid = valid.any(dim=1)
    rows_masked = (
        torch.zeros_like(row_valid)
        if masked_rows is None
        else masked_rows.to(device=delta.device, dtype=torch.bool).reshape(-1) & row_valid
    )
    weights = torch.where(valid, torch.exp(delta.clamp(-_LOG_WEIGHT_CAP, _LOG_WEIGHT_CAP)), 0.0)
    return torch.stack(
        [
            valid.sum().to(torch.float64),
            delta.square().sum(),
            kept.sum().to(torch.float64),
            torch.where(kept, after.square(), 0.0).sum(),
            (valid & ~kept).sum().to(torch.float64),
            clipped.sum().to(torch.float64),
            row_valid.sum().to(torch.float64),
            rows_masked.sum().to(torch.float64),
            weights.sum(),
            weights.square().sum(),
        ]
    )


def batch_ess(sums: Tensor) -> tuple[Tensor, Tensor]:
    """(ESS, 1) of one batch's `offpolicy_sums`, the normalized ESS (Σw)² / (N Σw²); (0, 0) without tokens or weight,
    so that a window's ESS is the sum of the first over the sum of the second (no host sync)."""
    i = OFFPOLICY_SUM_KEYS.index
    tokens, weight_sum, weight_sq_sum = sums[i("tokens")], sums[i("weight_sum")], sums[i("weight_sq_sum")]
    has = (tokens > 0) & (weight_sq_sum > 0)
    ess = torch.where(has, weight_sum.square() / (tokens * weight_sq_sum).clamp(min=1e-300), 0.0)
    return ess, has.to(sums.dtype)


def offpolicy_metrics(
    sums: Tensor, ess_sum: float, ess_count: float, ess_min: float, age_counts: Tensor, token_ages: Tensor
) -> dict[str, float]:
    """The `offpolicy/*` figures of a logging window, from its totals over every rank: `sums` the
    `OFFPOLICY_SUM_KEYS` summed over its batches, the ESS of each batch summed (`ess_sum`, `ess_count` batches) and
    its minimum, `age_counts[a]` the rows of age a (`row_age_counts`) and `token_ages` (Σ age, count) over completion
    tokens. Fractions and means are token- or row-weighted over the window; a figure with nothing to measure is
    left out."""
    out: dict[str, float] = {}
    s = dict(zip(OFFPOLICY_SUM_KEYS, sums.tolist(), strict=True))
    tokens, kept, rows = s["tokens"], s["kept_tokens"], s["rows"]
    if tokens:
        out["offpolicy/delta_sq_before"] = s["delta_sq"] / tokens
        out["offpolicy/delta_sq_after"] = s["delta_sq_kept"] / kept if kept else 0.0
        out["offpolicy/masked_fraction"] = s["masked_tokens"] / tokens
        out["offpolicy/clipped_fraction"] = s["clipped_tokens"] / tokens
    if rows:
        out["offpolicy/sequence_masked_fraction"] = s["masked_rows"] / rows
    if ess_count:
        out["offpolicy/ess"] = ess_sum / ess_count
        out["offpolicy/ess_min"] = ess_min
    counts = {age: count for age, count in enumerate(age_counts.tolist()) if count}
    if counts:
        total = sum(counts.values())
        out["offpolicy/row_age_min"] = float(min(counts))
        out["offpolicy/row_age_mean"] = sum(a * c for a, c in counts.items()) / total
        out["offpolicy/row_age_max"] = float(max(counts))
    age_sum, token_count = token_ages.tolist()
    if token_count:
        out["offpolicy/token_age_mean"] = age_sum / token_count
    return out


def row_age_counts(ages: Tensor, max_age: int) -> Tensor:
    """(max_age + 2,) float64 counts of `ages` (B,): bucket a for age a ≤ max_age, the last for anything older."""
    ages = ages.detach().to(torch.long).clamp(min=0, max=max_age + 1).reshape(-1)
    # index_add_ into the known buckets, not bincount: bincount reads the largest value on the host (a device sync).
    counts = torch.zeros(max_age + 2, dtype=torch.float64, device=ages.device)
    return counts.index_add_(0, ages, torch.ones_like(ages, dtype=torch.float64))


def log_histogram_to_trackers(callbacks, name: str, counts: dict[int, float], step: int) -> None:
    """Send a histogram of integer values (`counts[value]` occurrences) to the trackers among `callbacks` that take
    histograms: TensorBoard (`add_histogram`), W&B and Trackio (their `Histogram` from bin edges). TRL's logs carry
    floats only (they end in `trainer_state.json`), so histograms go to the trackers directly, on the main process."""
    if not counts:
        return
    import numpy as np

    values = np.arange(min(counts), max(counts) + 1)
    hist = np.array([counts.get(int(v), 0.0) for v in values], dtype=np.float64)
    edges = np.append(values - 0.5, values[-1] + 0.5)
    for callback in callbacks:
        kind = type(callback).__name__
        if kind == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            callback.tb_writer.add_histogram_raw(
                name,
                min=float(values[0]),
                max=float(values[-1]),
                num=float(hist.sum()),
                sum=float((values * hist).sum()),
                sum_squares=float((values**2 * hist).sum()),
                bucket_limits=edges[1:].tolist(),
                bucket_counts=hist.tolist(),
                global_step=step,
            )
        elif kind == "WandbCallback" and getattr(callback, "_wandb", None) is not None:
            wandb = callback._wandb
            wandb.log({f"train/{name}": wandb.Histogram(np_histogram=(hist, edges)), "train/global_step": step})
        elif kind == "TrackioCallback" and getattr(callback, "_trackio", None) is not None:
            trackio = callback._trackio
            trackio.log({f"train/{name}": trackio.Histogram(np_histogram=(hist, edges)), "train/global_step": step})


def importance_weight_sums(
    delta: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> Tensor:
    """`offpolicy_sums` for TRL's truncated importance weight (`importance.truncated_importance_weights`): `weights` is
    (B, T) in token modes, (B, 1) in sequence modes. Kept: a non-zero weight. Clipped (truncate modes): a weight on a
    bound (a ratio exactly on a bound has probability zero). δ' is log w per token in token modes; in sequence modes
    the weight is the row's, so δ' stays δ on the rows kept and a clamped row counts as clipped."""
    valid = mask.to(device=delta.device, dtype=torch.bool).expand(delta.shape)
    full = weights.to(delta.device).expand(delta.shape)
    sequence = mode.startswith("sequence")
    clipped = None
    if mode.endswith("truncate"):
        clipped = weights_on_a_bound(full, clip_min, clip_max) & valid
    after = None if sequence else torch.log(full.clamp(min=torch.finfo(full.dtype).tiny))
    masked_rows = (weights.reshape(-1) == 0) if sequence and mode.endswith("mask") else None
    return offpolicy_sums(delta, mask, kept=(full != 0) & valid, delta_after=after, clipped=clipped,
                          masked_rows=masked_rows)  # fmt: skip


def m2po_offpolicy_sums(delta: Tensor, mask: Tensor, selection) -> Tensor:
    """`offpolicy_sums` for an M2PO selection (`losses.M2POSelection`): kept are the tokens left in the objective;
    under `authors_code` a clipped token stays in it at its bound, which is its δ'."""
    kept, after = selection.keep, None
    if selection.clipped is not None:
        bound = torch.where(delta.detach() > 0, selection.clip_log_high, selection.clip_log_low)
        after = torch.where(selection.clipped, bound.to(delta.dtype), delta.detach())
        kept = kept | selection.clipped
    return offpolicy_sums(delta, mask, kept=kept, delta_after=after, clipped=selection.clipped)
