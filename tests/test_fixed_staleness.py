"""`fixed_staleness=k`: every batch is generated with exactly the weights the bound allows, whatever the timing.

Staleness is measured from the weights that really generated each batch (`WeightTracingTrainer` finds the version
whose log-probs reproduce the behaviour log-probs μ), never from the engine's own tags.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_utils import WeightTracingTrainer, length_reward, load_model, make_args
from trl_async import AsyncGRPOConfig


def slow_generation_reward(completions, **kwargs):
    import time

    time.sleep(0.3)  # the generator is slower than a training step: the trainer must wait for held-back weights
    return length_reward(completions)


@pytest.mark.parametrize(
    ("schedule", "k", "reward"),
    [
        (dict(), 3, length_reward),  # one generation batch per optimizer step: batch n from version n - k
        (dict(), 2, slow_generation_reward),
        # each batch trained on twice, at versions 2n and 2n + 1 (its last use): generated with version 2n + 1 - k
        (dict(num_iterations=2), 3, length_reward),
    ],
    ids=["default_k3", "slow_generator_k2", "num_iterations_k3"],
)
def test_every_row_is_exactly_k_versions_old_at_its_last_use(tmp_path, dataset, tokenizer, schedule, k, reward):
    uses = schedule.get("num_iterations", 1)
    args = make_args(tmp_path, max_steps=10, loss_type="dapo", fixed_staleness=k, **schedule)
    assert args.max_staleness == k
    trainer = WeightTracingTrainer(
        model=load_model(), reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.loss_versions == list(range(10)), trainer.loss_versions
    # Batch n is last used at version uses*n + uses - 1 and was generated with the weights k versions before that
    # (the initial weights while fewer than k versions exist). A step with zero gradient leaves the weights as they
    # were, so several versions may reproduce μ: the expected one must be among them.
    for version, generating in zip(trainer.loss_versions, trainer.generating_versions, strict=True):
        last_use = (version // uses) * uses + uses - 1
        assert max(0, last_use - k) in generating, (version, generating)
    assert max(trainer.tagged_staleness) == k  # the pipeline filled
    assert all(trainer.tag_is_true)


def test_fixed_staleness_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        make_args(tmp_path, fixed_staleness=2, max_staleness=3)
    with pytest.raises(ValueError, match="weight_sync_steps"):
        make_args(tmp_path, fixed_staleness=2, weight_sync_steps=2)
    with pytest.raises(ValueError, match="queue_capacity"):
        make_args(tmp_path, fixed_staleness=2, queue_capacity=1)
    with pytest.raises(ValueError, match="fixed_staleness must be"):
        make_args(tmp_path, fixed_staleness=-1)
    with pytest.raises(ValueError, match="async_generation"):
        make_args(tmp_path, fixed_staleness=1, async_generation=False)
    with pytest.raises(ValueError, match="max_staleness >= 1"):  # the schedule's own span still applies
        make_args(tmp_path, fixed_staleness=0, num_iterations=2)
    assert make_args(tmp_path, fixed_staleness=4).max_staleness == 4
    assert isinstance(make_args(tmp_path, fixed_staleness=4), AsyncGRPOConfig)
