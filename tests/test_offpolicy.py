"""`offpolicy/*` diagnostics: the pure sums against loops written by hand, and in real runs against log-probs
recomputed here from the model (a plain forward, not the trainer's) and μ from the batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.trainer_utils import WeightTracingTrainer, length_reward, load_model, make_args
from trl_async import AsyncGRPOTrainer
from trl_async.algorithms.importance import truncated_importance_weights
from trl_async.algorithms.offpolicy import (
    OFFPOLICY_SUM_KEYS,
    batch_ess,
    importance_weight_sums,
    offpolicy_metrics,
    offpolicy_sums,
    row_age_counts,
)


def _random_case(seed: int, rows=5, width=7):
    rng = random.Random(seed)
    delta = [[rng.gauss(0.0, 0.7) for _ in range(width)] for _ in range(rows)]
    lengths = [rng.randint(0, width) for _ in range(rows)]
    mask = [[1 if t < lengths[r] else 0 for t in range(width)] for r in range(rows)]
    kept = [[rng.random() < 0.7 for _ in range(width)] for _ in range(rows)]
    after = [[d * 0.5 for d in row] for row in delta]
    clipped = [[rng.random() < 0.2 for _ in range(width)] for _ in range(rows)]
    masked_rows = [rng.random() < 0.3 for _ in range(rows)]
    return delta, mask, kept, after, clipped, masked_rows


def _by_hand(delta, mask, kept, after, clipped, masked_rows):
    sums = dict.fromkeys(OFFPOLICY_SUM_KEYS, 0.0)
    for r, row in enumerate(delta):
        row_has_token = False
        for t, d in enumerate(row):
            if not mask[r][t]:
                continue
            row_has_token = True
            sums["tokens"] += 1
            sums["delta_sq"] += d * d
            sums["weight_sum"] += math.exp(d)
            sums["weight_sq_sum"] += math.exp(2 * d)
            if kept[r][t]:
                sums["kept_tokens"] += 1
                sums["delta_sq_kept"] += after[r][t] ** 2
            else:
                sums["masked_tokens"] += 1
            sums["clipped_tokens"] += bool(clipped[r][t])
        if row_has_token:
            sums["rows"] += 1
            sums["masked_rows"] += bool(masked_rows[r])
    return [sums[k] for k in OFFPOLICY_SUM_KEYS]


@pytest.mark.parametrize("seed", range(6))
def test_offpolicy_sums_equal_a_loop_over_tokens(seed):
    case = _random_case(seed)
    delta, mask, kept, after, clipped, masked_rows = case
    got = offpolicy_sums(
        torch.tensor(delta, dtype=torch.float64),
        torch.tensor(mask),
        kept=torch.tensor(kept),
        delta_after=torch.tensor(after, dtype=torch.float64),
        clipped=torch.tensor(clipped),
        masked_rows=torch.tensor(masked_rows),
    )
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(_by_hand(*case), rel=1e-9, abs=1e-12)


def test_defaults_keep_every_valid_token_unclipped():
    delta, mask, *_ = _random_case(7)
    rows, width = len(delta), len(delta[0])
    got = offpolicy_sums(torch.tensor(delta, dtype=torch.float64), torch.tensor(mask))
    everything = [[True] * width for _ in range(rows)]
    nothing = [[False] * width for _ in range(rows)]
    assert got.tolist() == pytest.approx(_by_hand(delta, mask, everything, delta, nothing, [False] * rows))


def test_window_metrics_are_token_weighted_and_ess_is_per_batch():
    first = offpolicy_sums(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4))  # on-policy: every weight 1, ESS 1
    second = offpolicy_sums(torch.tensor([[math.log(4.0), 0.0]]), torch.ones(1, 2))  # weights 4, 1: ESS 25 / 34
    (ess_1, has_1), (ess_2, has_2) = batch_ess(first), batch_ess(second)
    assert (float(ess_1), float(ess_2)) == pytest.approx((1.0, 25.0 / 34.0))
    empty_ess, empty_has = batch_ess(offpolicy_sums(torch.zeros(1, 2), torch.zeros(1, 2)))  # no valid token
    assert (float(empty_ess), float(empty_has)) == (0.0, 0.0)
    metrics = offpolicy_metrics(
        first + second,
        float(ess_1 + ess_2),
        float(has_1 + has_2 + empty_has),
        float(min(ess_1, ess_2)),
        torch.tensor([3.0, 0.0, 2.0]),  # three rows of age 0, two of age 2
        torch.tensor([8.0, 6.0]),
    )
    assert metrics["offpolicy/ess"] == pytest.approx((1.0 + 25.0 / 34.0) / 2)
    assert metrics["offpolicy/ess_min"] == pytest.approx(25.0 / 34.0)
    assert metrics["offpolicy/delta_sq_before"] == pytest.approx(math.log(4.0) ** 2 / 6)  # over all 6 tokens
    assert metrics["offpolicy/delta_sq_after"] == pytest.approx(math.log(4.0) ** 2 / 6)
    assert metrics["offpolicy/masked_fraction"] == 0.0
    assert (metrics["offpolicy/row_age_min"], metrics["offpolicy/row_age_max"]) == (0.0, 2.0)
    assert metrics["offpolicy/row_age_mean"] == pytest.approx(4.0 / 5.0)
    assert metrics["offpolicy/token_age_mean"] == pytest.approx(8.0 / 6.0)
    # A window with nothing measured logs nothing (rather than zeros that would read as "on-policy").
    assert offpolicy_metrics(torch.zeros(len(first)), 0.0, 0.0, math.inf, torch.zeros(3), torch.zeros(2)) == {}


def test_row_age_counts_put_older_rows_in_the_last_bucket():
    counts = row_age_counts(torch.tensor([0, 2, 2, 1, 7]), max_age=2)
    assert counts.tolist() == [1.0, 1.0, 2.0, 1.0]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weight_sums_follow_trls_weight(mode):
    generator = torch.Generator().manual_seed(3)
    old = torch.randn(6, 5, generator=generator) * 0.2 - 1.0
    mu = old + torch.randn(6, 5, generator=generator) * 1.2
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 5, 1, 4, 2])[:, None]).long()
    clip_min, clip_max = 0.5, 2.0
    weights = truncated_importance_weights(old, mu, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
    got = dict(zip(OFFPOLICY_SUM_KEYS, importance_weight_sums(
        old - mu, mask, weights, mode=mode, clip_min=clip_min, clip_max=clip_max).tolist(), strict=True))  # fmt: skip
    # By hand: the ratio per token or per row, where it lands against [0.5, 2].
    kept = masked = clipped = masked_rows = 0
    after_sq = 0.0
    for r in range(6):
        n = int(mask[r].sum())
        row_log = float(sum(old[r, t] - mu[r, t] for t in range(n)))
        for t in range(n):
            log_ratio = row_log if mode.startswith("sequence") else float(old[r, t] - mu[r, t])
            outside = not (clip_min <= math.exp(log_ratio) <= clip_max)
            if mode.endswith("mask") and outside:
                masked += 1
                continue
            kept += 1
            clipped += mode.endswith("truncate") and outside
            if mode.startswith("sequence"):
                after_sq += float(old[r, t] - mu[r, t]) ** 2
            else:
                after_sq += min(max(log_ratio, math.log(clip_min)), math.log(clip_max)) ** 2
        if mode == "sequence_mask" and n and not (clip_min <= math.exp(row_log) <= clip_max):
            masked_rows += 1
    assert (got["kept_tokens"], got["masked_tokens"], got["clipped_tokens"]) == (kept, masked, clipped)
    assert got["masked_rows"] == masked_rows
    assert got["delta_sq_kept"] == pytest.approx(after_sq, rel=1e-5)
    assert kept and (masked or clipped)  # the case exercises the treatment


# ----------------------------------------------------------------------------------------------- in a real run
class _RecomputingTrainer(WeightTracingTrainer):
    """Records, per optimizer step, E[δ²] and the ESS of π_old/μ recomputed with a plain forward of the current model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recomputed: dict[int, tuple[float, float]] = {}

    def _compute_loss(self, model, inputs):
        if self.model.training and "sampling_per_token_logps" in inputs:
            with torch.no_grad():
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
                attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                width = inputs["completion_ids"].size(1)
                logits = self.accelerator.unwrap_model(self.model)(input_ids=ids, attention_mask=attention).logits
                logits = logits[:, -width - 1 : -1].float() / self.temperature
                logps = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
            valid = inputs["completion_mask"].bool()
            delta = (logps - inputs["sampling_per_token_logps"])[valid].double()
            weights = delta.exp()
            ess = float(weights.sum() ** 2 / (delta.numel() * weights.square().sum()))
            self.recomputed[self.state.global_step] = (float(delta.square().mean()), ess)
        return super()._compute_loss(model, inputs)


def _logged(trainer, key):
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


@pytest.mark.parametrize("k", [0, 3])
def test_offpolicy_metrics_in_a_run_equal_a_recomputation_and_move_with_staleness(tmp_path, dataset, tokenizer, k):
    args = make_args(
        tmp_path, max_steps=8, loss_type="dapo", fixed_staleness=k, vllm_importance_sampling_correction=False
    )
    trainer = _RecomputingTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    delta_sq, ess = _logged(trainer, "offpolicy/delta_sq_before"), _logged(trainer, "offpolicy/ess")
    ages = _logged(trainer, "offpolicy/row_age_mean")
    assert sorted(delta_sq) == list(range(1, 9))  # every step logged it (log step = version after the step)
    for version, (expected_delta_sq, expected_ess) in trainer.recomputed.items():
        assert delta_sq[version + 1] == pytest.approx(expected_delta_sq, rel=1e-3, abs=1e-9)
        assert ess[version + 1] == pytest.approx(expected_ess, rel=1e-4)
    # Nothing is treated without the correction: after = before.
    assert _logged(trainer, "offpolicy/delta_sq_after") == pytest.approx(delta_sq)
    # Row ages against the weights that really generated each batch (one batch per step here).
    for version, generating in zip(trainer.loss_versions, trainer.generating_versions, strict=True):
        assert version - ages[version + 1] in generating
    if k == 0:
        assert max(delta_sq.values()) < 1e-8 and min(ess.values()) > 1 - 1e-6
    else:  # filled pipeline: rows 3 versions old, the ratio spread out
        filled = [v for v in delta_sq if v > k]
        assert min(delta_sq[v] for v in filled) > 1e-4
        assert max(ess[v] for v in filled) < 1 - 1e-5
        assert all(ages[v] == k for v in filled)


def test_m2po_sums_count_masked_and_clipped_tokens_of_the_selection():
    from trl_async.algorithms.m2po import m2po_select
    from trl_async.algorithms.offpolicy import m2po_offpolicy_sums

    generator = torch.Generator().manual_seed(5)
    delta = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.6
    mask = (torch.arange(6)[None] < torch.tensor([6, 4, 6, 2])[:, None]).long()
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-2.0]], dtype=torch.float64)
    paper = m2po_select(delta, mask, 0.04, advantages, "paper")
    sums = dict(zip(OFFPOLICY_SUM_KEYS, m2po_offpolicy_sums(delta, mask, paper).tolist(), strict=True))
    valid = mask.bool()
    keep = paper.keep & valid
    assert 0 < keep.sum() < valid.sum()
    assert sums["masked_tokens"] == float((valid & ~keep).sum())
    assert sums["delta_sq_kept"] == pytest.approx(float(delta[keep].square().sum()))
    authors = m2po_select(delta, mask, 0.04, advantages, "authors_code")
    assert authors.clipped is not None and authors.clipped.any()
    sums = dict(zip(OFFPOLICY_SUM_KEYS, m2po_offpolicy_sums(delta, mask, authors).tolist(), strict=True))
    assert sums["clipped_tokens"] == float((authors.clipped & valid).sum())
    bound = torch.where(delta > 0, authors.clip_log_high, authors.clip_log_low).to(torch.float64)
    expected = torch.where(authors.clipped, bound, delta)[(authors.keep | authors.clipped) & valid]
    assert sums["delta_sq_kept"] == pytest.approx(float(expected.square().sum()))


def test_delta_sq_after_is_the_mean_over_the_tokens_kept_after_masking_and_clipping():
    """Issue 33, guarantee 1: a window whose loss really removed tokens. One batch under `token_mask`, one under
    `token_truncate`, both with [0.5, 2]; every figure below is worked out by hand from the ratios."""
    clip_min, clip_max = 0.5, 2.0
    # token_mask: ratios 1.5 (kept), 4 and 1/4 (outside: weight 0), 1 (kept); the last position is padding, its δ
    # deliberately large so that counting it would show.
    masked_delta = torch.tensor([[math.log(1.5), math.log(4.0), math.log(0.25), 0.0, 5.0]], dtype=torch.float64)
    masked_valid = torch.tensor([[1, 1, 1, 1, 0]])
    # token_truncate: ratios 3 (clamped to 2), 0.8 (inside), 1/8 (clamped to 0.5); all three kept.
    clipped_delta = torch.tensor([[math.log(3.0), math.log(0.8), math.log(0.125)]], dtype=torch.float64)
    clipped_valid = torch.ones(1, 3, dtype=torch.long)
    window = torch.zeros(len(OFFPOLICY_SUM_KEYS), dtype=torch.float64)
    for mode, delta, valid in (
        ("token_mask", masked_delta, masked_valid),
        ("token_truncate", clipped_delta, clipped_valid),
    ):
        behaviour = torch.zeros_like(delta)
        weights = truncated_importance_weights(
            delta, behaviour, valid, mode=mode, clip_min=clip_min, clip_max=clip_max
        )
        window += importance_weight_sums(delta, valid, weights, mode=mode, clip_min=clip_min, clip_max=clip_max)
    metrics = offpolicy_metrics(window, 1.0, 1.0, 1.0, torch.zeros(2), torch.zeros(2))
    # 7 valid tokens; 2 masked (4, 1/4); 2 clipped (3 -> 2, 1/8 -> 1/2); 5 kept, with δ' = log of the weight applied:
    # log 1.5, log 1, log 2, log 0.8, log 0.5.
    kept_sq = [math.log(1.5) ** 2, 0.0, math.log(2.0) ** 2, math.log(0.8) ** 2, math.log(0.5) ** 2]
    valid_sq = [math.log(r) ** 2 for r in (1.5, 4.0, 0.25, 1.0, 3.0, 0.8, 0.125)]
    assert metrics["offpolicy/masked_fraction"] == pytest.approx(2 / 7)
    assert metrics["offpolicy/clipped_fraction"] == pytest.approx(2 / 7)
    assert metrics["offpolicy/delta_sq_after"] == pytest.approx(sum(kept_sq) / 5, rel=1e-12)
    assert metrics["offpolicy/delta_sq_before"] == pytest.approx(sum(valid_sq) / 7, rel=1e-12)
    # The case tells the kept-token mean from the all-token one (what a wrong denominator would log).
    assert sum(kept_sq) / 5 != pytest.approx(sum(kept_sq) / 7, rel=1e-3)


class _KeptTokensRecomputingTrainer(AsyncGRPOTrainer):
    """Records, per optimizer step, δ = log π_old − log μ per valid token, π_old from a plain forward of the current
    model (not the trainer's), for recomputing what TRL's token_mask keeps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deltas: dict[int, torch.Tensor] = {}

    def _compute_loss(self, model, inputs):
        if self.model.training and "sampling_per_token_logps" in inputs:
            with torch.no_grad():
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
                attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                width = inputs["completion_ids"].size(1)
                logits = self.accelerator.unwrap_model(self.model)(input_ids=ids, attention_mask=attention).logits
                logits = logits[:, -width - 1 : -1].float() / self.temperature
                logps = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
            valid = inputs["completion_mask"].bool()
            assert self.state.global_step not in self.deltas  # one batch per optimizer step
            self.deltas[self.state.global_step] = (logps - inputs["sampling_per_token_logps"])[valid].double()
        return super()._compute_loss(model, inputs)


def test_delta_sq_after_in_a_token_mask_run_is_the_mean_over_the_tokens_the_mask_kept(tmp_path, dataset, tokenizer):
    """Issue 33, guarantee 1, in a real run: rows 3 versions old under `token_mask` with tight bounds, so the loss
    masks a good share of the tokens. `offpolicy/delta_sq_after` must be E[δ²] over the tokens whose weight stayed
    non-zero, recomputed here from an independent forward; neither the mean over every valid token nor the kept
    tokens' sum over every valid token."""
    clip_min, clip_max = 0.9, 1.1
    args = make_args(
        tmp_path,
        max_steps=8,
        loss_type="dapo",
        fixed_staleness=3,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    trainer = _KeptTokensRecomputingTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    after, masked = _logged(trainer, "offpolicy/delta_sq_after"), _logged(trainer, "offpolicy/masked_fraction")
    ages = _logged(trainer, "offpolicy/row_age_mean")
    assert sorted(after) == list(range(1, 9)) and sorted(trainer.deltas) == list(range(8))
    assert max(ages.values()) == 3  # the pipeline filled: stale rows entered the loss
    steps_with_masking = 0
    for version, delta in trainer.deltas.items():
        kept = (delta.exp() >= clip_min) & (delta.exp() <= clip_max)  # TRL's token_mask keeps ratios in the bounds
        assert masked[version + 1] == pytest.approx(1.0 - kept.double().mean().item(), abs=1e-9), version
        if kept.all():
            continue
        steps_with_masking += 1
        assert kept.any(), version
        expected = float(delta[kept].square().mean())
        assert after[version + 1] == pytest.approx(expected, rel=1e-3, abs=1e-9), version
        # Premise: on this step the right figure is told apart from the wrong denominators.
        over_every_token = float(delta.square().mean())
        kept_sum_over_every_token = float(delta[kept].square().sum() / delta.numel())
        assert expected != pytest.approx(over_every_token, rel=1e-2)
        assert expected != pytest.approx(kept_sum_over_every_token, rel=1e-2)
    assert steps_with_masking >= 3, masked
