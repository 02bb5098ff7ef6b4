"""The typed rollout fields (`trainers.batch`) and the trainers' per-window statistics (`trainers.statistics`): pure
code, no model."""

from __future__ import annotations

import math

import pytest
import torch

from trl_async.rollout.payload import RolloutPayload
from trl_async.rollout.pipeline import RolloutBatch
from trl_async.trainers.batch import RolloutFields, rollout_fields, rollout_view
from trl_async.trainers.statistics import MAX, MIN, Field, StatisticsLayout, WindowStatistics


def _batch(version: int, token_versions=None, rows: int = 2) -> RolloutBatch:
    payload = RolloutPayload(
        rows=[{"prompt": "p"}] * rows, stream_index=0, prompt_ids=[[1]] * rows, completion_ids=[[5, 6, 7], [5]],
        logprobs=[[0.0] * 3, [0.0]], rewards_per_func=torch.zeros(rows, 1), completions=None, extra_logs={},
        logged_metrics={}, generate_s=0.0, reward_s=0.0, token_versions=token_versions,
    )  # fmt: skip
    return RolloutBatch(payload, version=version, staleness=0, from_trainer=token_versions is None)


def test_every_rollout_batch_gets_every_version_field_whoever_made_it():
    completion_ids = torch.zeros(2, 4, dtype=torch.long)
    # Made by the trainer at start-up (no per-token versions): every token has the row's version.
    made_here = rollout_fields(_batch(7), completion_ids)
    # From the generation process with in-flight updates: the recorded versions, padded with the row's last one.
    generated = rollout_fields(_batch(7, token_versions=[[7, 8, 9], [7]]), completion_ids)
    assert set(made_here) == set(generated) == {"rollout_versions", "rollout_token_versions"}
    assert made_here["rollout_versions"].tolist() == generated["rollout_versions"].tolist() == [7, 7]
    assert made_here["rollout_token_versions"].tolist() == [[7] * 4, [7] * 4]
    assert generated["rollout_token_versions"].tolist() == [[7, 8, 9, 9], [7, 7, 7, 7]]
    for fields in (made_here, generated):  # same shapes and dtypes: what the ranks reduce never differs in form
        assert (
            fields["rollout_token_versions"].shape == (2, 4) and fields["rollout_token_versions"].dtype == torch.long
        )


def test_a_rollout_batch_missing_a_field_is_an_error_naming_it():
    full = {name: torch.zeros(2, 3) for name in RolloutFields.__annotations__}
    assert set(rollout_view(full)) == set(RolloutFields.__annotations__)
    for missing in RolloutFields.__annotations__:
        partial = {k: v for k, v in full.items() if k != missing}
        with pytest.raises(KeyError, match=missing):
            rollout_view(partial)


def _two_rank_gather(other: WindowStatistics):
    """The all-gather of two ranks, written out: this rank's (1, K) vector stacked with the other rank's."""

    def gather(values):
        return torch.cat([values, other.values.unsqueeze(0)])

    return gather


def test_statistics_combine_over_the_window_and_the_ranks_by_each_fields_reduction():
    layout = StatisticsLayout([Field("sums", 2), Field("low", 1, MIN), Field("high", 1, MAX)])
    rank0, rank1 = WindowStatistics(layout, "cpu"), WindowStatistics(layout, "cpu")
    rank0.add("sums", [1.0, 10.0])
    rank0.add("sums", torch.tensor([2.0, 20.0]))
    rank0.add("low", 0.5)
    rank0.add("low", 0.25)
    rank0.add("high", 3.0)
    rank1.add("sums", [4.0, 40.0])  # rank 1 recorded no extreme at all: it still joins with the same shape
    rank0.reduce(_two_rank_gather(rank1))
    totals = rank0.take()
    assert totals["sums"].tolist() == [7.0, 70.0]
    assert totals["low"].tolist() == [0.25] and totals["high"].tolist() == [3.0]
    assert rank0.take() is None  # taken once
    # The window starts afresh after a reduction; totals not taken yet are combined with the next ones.
    rank0.add("sums", [1.0, 1.0])
    rank0.reduce(_two_rank_gather(WindowStatistics(layout, "cpu")))
    rank0.add("low", 0.125)
    rank0.reduce(_two_rank_gather(WindowStatistics(layout, "cpu")))
    totals = rank0.take()
    assert totals["sums"].tolist() == [1.0, 1.0] and totals["low"].tolist() == [0.125]
    assert totals["high"].tolist() == [-math.inf]  # nothing recorded: the neutral value


def test_statistics_refuse_a_value_of_the_wrong_size_and_a_field_declared_twice():
    statistics = WindowStatistics(StatisticsLayout([Field("sums", 2)]), "cpu")
    with pytest.raises(ValueError, match="sums"):
        statistics.add("sums", [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="twice"):
        StatisticsLayout([Field("a"), Field("a")])
