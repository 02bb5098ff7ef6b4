"""How many times the tensor rewards and one training step's correction and statistics would make the host wait for a
GPU, counted on the CPU (`tests/support/host_syncs.py`). The counts asserted here are the ones docs/m2po.md and
docs/rewards.md state:

* the tensor rewards (math answer, pattern, per-row pattern, format, length): 0 per batch;
* a training micro-step's correction against μ and its statistics (`trainers.correction`, `trainers.statistics`,
  the engine's recording): 0 with TRL's loss types, 1 with M2PO (its selection's one read);
* a logging step: 1 (the window's totals read once, after the one all-gather).

The trainer's micro-step is a real `_compute_loss` + backward of the bundled tiny model, with M2PO's accelerator
branch forced (on a CPU it would read its sums directly); only the syncs made by trl_async's own code are counted
(TRL's loss and transformers' masks make their own). The shared-prompt forward (`trainers/forward.py`) reads its group
sizes to build the packed shapes; it is counted apart, as docs/m2po.md says.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import trl_async
from tests.support.host_syncs import count_host_syncs
from tests.support.trainer_utils import length_reward, load_model, load_tokenizer, make_args, make_batch
from trl_async import AsyncGRPOTrainer
from trl_async.algorithms.m2po import fast, global_scope
from trl_async.rewards import FormatReward, LengthPenalty, MathAnswerReward, TokenPatternReward
from trl_async.rewards.runner import score_completions
from trl_async.rollout.pipeline import ASYNC_WINDOW_KEYS
from trl_async.toy import make_arithmetic_dataset
from trl_async.trainers.statistics import StatisticsLayout, WindowStatistics, record_async_window, trainer_fields

PACKAGE = os.path.dirname(os.path.abspath(trl_async.__file__))
FORWARD_PACKING = os.path.join(PACKAGE, "trainers", "forward.py")


# ----------------------------------------------------------------------------------------------------- rewards
def _completions(tok):
    texts = ["So 3 + 4 = 7. #### 7", "I think it is 12", "#### 5, no wait: The answer is 6", "\\boxed{9} done"]
    eos = tok.eos_token_id
    rows = [tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
    width = max(len(r) for r in rows) + 2
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask, ["7", "12", "6", "9"], eos


def _rewards(tok):
    """Each built-in tensor reward, and the dataset columns it reads."""
    _, _, answers, eos = _completions(tok)
    math_reward = MathAnswerReward(tok)
    math_reward.prepare(answers)
    targets = [tok.encode(a, add_special_tokens=False) for a in answers]
    return {
        "math": (math_reward, {"answer": answers}),
        "pattern": (TokenPatternReward(pattern=tok.encode("####", add_special_tokens=False), eos_token_id=eos), {}),
        "pattern_per_row": (
            TokenPatternReward(pattern_column="target_ids", eos_token_id=eos),
            {"target_ids": targets},
        ),
        "format": (FormatReward(tok, required=("####",)), {}),
        "length": (LengthPenalty(32, 4), {}),
    }


@pytest.mark.parametrize("name", ["math", "pattern", "pattern_per_row", "format", "length"])
def test_tensor_rewards_make_no_host_sync(name):
    tok = load_tokenizer()
    ids, mask, _, _ = _completions(tok)
    reward, columns = _rewards(tok)[name]
    expected = reward(ids, mask, **columns)  # first use: device tables are built and uploaded once, off the batch path
    with count_host_syncs() as syncs:
        got = reward(ids, mask, **columns)
    assert syncs.count == 0, syncs.report()
    assert torch.equal(got, expected)


def test_scoring_a_batch_with_tensor_rewards_reads_once():
    # `score_completions` (the generation process's scoring) adds one read per batch: its check for an infinite
    # reward, just before the batch's rewards are copied to the host with the payload anyway.
    tok = load_tokenizer()
    ids, mask, _, _ = _completions(tok)
    rewards = _rewards(tok)
    funcs = [reward for reward, _ in rewards.values()]
    columns = {key: value for _, cols in rewards.values() for key, value in cols.items()}

    def score():
        return score_completions(funcs, ids, mask, columns, prompts=[""] * ids.size(0),
                                 decode=lambda: pytest.fail("nothing is decoded"))  # fmt: skip

    expected = score()
    with count_host_syncs() as syncs:
        got = score()
    assert syncs.count == 1 and "runner.py" in syncs.events[0].where, syncs.report()
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------- one training step
STEP_CASES = {
    "m2po_paper": dict(loss_type="m2po", m2po_rule="paper"),
    "m2po_all_tokens": dict(loss_type="m2po", m2po_rule="all_tokens"),
    "m2po_authors_code": dict(loss_type="m2po", m2po_rule="authors_code"),
    "dapo_token_truncate": dict(
        loss_type="dapo",
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=0.1,
        vllm_importance_sampling_clip_max=1.2,
    ),
    "dapo_sequence_mask": dict(loss_type="dapo", vllm_importance_sampling_mode="sequence_mask"),
    "grpo_token_mask": dict(loss_type="grpo", vllm_importance_sampling_mode="token_mask"),
}


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=32, num_test=4, seed=2)["train"]


def _trainer(tmp_path, dataset, **overrides):
    args = make_args(tmp_path, max_staleness=1, **overrides)  # stale rows: the correction applies
    trainer = AsyncGRPOTrainer(
        model=load_model(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _as_accelerator_memory(device, host_memory):
    return bool(host_memory) if host_memory is not None else False


def _accelerator_branch(monkeypatch):
    """M2PO's selection as on a GPU (one packed read; on a CPU it reads its sums directly, which costs nothing)."""
    monkeypatch.setattr(fast, "_in_host_memory", _as_accelerator_memory)
    monkeypatch.setattr(global_scope, "_in_host_memory", _as_accelerator_memory)


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_a_training_micro_step_corrects_and_records_with_at_most_the_selections_sync(
    tmp_path, dataset, monkeypatch, case
):
    _accelerator_branch(monkeypatch)
    trainer = _trainer(tmp_path, dataset, **STEP_CASES[case])
    inputs, _ = make_batch(trainer.processing_class, trainer.model, seed=3)
    trainer._compute_loss(trainer.model, dict(inputs)).backward()  # warm-up
    window_before = trainer._statistics["train"].values.clone()
    with count_host_syncs() as syncs:
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
    ours = [e for e in syncs.made_by(PACKAGE) if e.path != FORWARD_PACKING]
    allowed = 1 if case.startswith("m2po") else 0
    assert len(ours) <= allowed, syncs.report(ours)
    if allowed:  # and the one there is is the selection's read
        assert all("algorithms/m2po" in e.where for e in ours), syncs.report(ours)
    # The step did record its figures (the window changed), so the count covers the recording too.
    assert not torch.equal(trainer._statistics["train"].values, window_before)


def test_a_micro_batch_m2po_masked_whole_is_warned_about_at_log_time(tmp_path, dataset, caplog):
    # The all-masked flag is no longer read per micro-batch (a sync): the window counts it, the log warns.
    trainer = _trainer(tmp_path, dataset, loss_type="m2po", m2po_rule="all_tokens")
    inputs, policy = make_batch(trainer.processing_class, trainer.model, seed=3)
    inputs["sampling_per_token_logps"] = (policy + 3.0) * inputs["completion_mask"]  # δ² = 9 > τ everywhere
    trainer._compute_loss(trainer.model, dict(inputs))
    statistics = trainer._statistics["train"]
    statistics.reduce(lambda values: values)  # one rank: the gather is the identity
    with caplog.at_level(logging.WARNING, logger="trl_async.trainers.statistics"):
        trainer._log_statistics("train", statistics.take())
    assert "M2PO masked every token of 1 micro-batch(es)" in caplog.text
    assert trainer._metrics["train"]["m2po/all_masked_batches"] == [1.0]


def test_a_logging_step_reads_the_window_once():
    layout = StatisticsLayout(trainer_fields(max_age=2))
    statistics = WindowStatistics(layout, torch.device("cpu"))
    window = {key: 1.0 for key in ("batches", "rows")}
    with count_host_syncs() as syncs:
        statistics.add("offpolicy_ess", torch.ones(2) * 2)  # a step's figures, on the device
        record_async_window(statistics, _async_window(window))  # host numbers: copied without waiting
        statistics.reduce(lambda values: values)
        totals = statistics.take()  # the one read
    assert syncs.count == 1, syncs.report()
    assert totals["offpolicy_ess"].tolist() == [2.0, 2.0]


def _async_window(values: dict) -> dict:
    return {**{key: values.get(key, 0.0) for key in ASYNC_WINDOW_KEYS}, "staleness_max": 0.0}
