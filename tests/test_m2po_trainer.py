"""loss_type="m2po" inside AsyncGRPOTrainer, on the bundled tiny model."""

import math

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.assets import tiny_model_path
from trl_async.data import make_arithmetic_dataset
from trl_async.rewards import MathAnswerReward


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=128, num_test=8, seed=2)["train"]


def train(tmp_path, tokenizer, dataset, **overrides):
    kwargs = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=24, learning_rate=1e-3, logging_steps=1, report_to="none",
                  save_strategy="no", bf16=False, loss_type="m2po", max_staleness=1)  # fmt: skip
    kwargs.update(overrides)
    trainer = AsyncGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=MathAnswerReward(tokenizer),
        args=AsyncGRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "reward" in h]


@pytest.mark.parametrize("variant", ["paper", "token"])
def test_m2po_trains_with_finite_loss_and_metrics(tmp_path, tokenizer, dataset, variant):
    logged = train(tmp_path, tokenizer, dataset, m2po_variant=variant)
    assert len(logged) == 4
    for entry in logged:
        assert math.isfinite(entry["loss"])
        for key in ("m2po/masked_fraction", "m2po/m2_before", "m2po/m2_after"):
            assert key in entry and math.isfinite(entry[key])
        assert 0.0 <= entry["m2po/masked_fraction"] <= 1.0
    # Stale rows (staleness 1 after the first step, lr 1e-3) really diverge from the current policy.
    assert max(entry["m2po/m2_before"] for entry in logged[1:]) > 0
    if variant == "paper":
        # The paper rule caps the kept tokens' second moment at the threshold.
        assert all(entry["m2po/m2_after"] <= 0.04 + 1e-6 for entry in logged)


def test_m2po_on_synchronous_path_without_behaviour_logps_keeps_everything(tmp_path, tokenizer, dataset):
    """TRL's own generation (async off) returns no sampling log-probs and, aligned, no old_per_token_logps: the
    batch is on-policy, the ratio is 1 and nothing is masked."""
    logged = train(tmp_path, tokenizer, dataset, async_generation=False, max_steps=2)
    assert all(entry["m2po/masked_fraction"] == 0.0 for entry in logged)
    assert all(entry["m2po/m2_before"] == 0.0 for entry in logged)


def test_m2po_rejects_features_it_does_not_implement(tmp_path, tokenizer, dataset):
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        AsyncGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
            reward_funcs=MathAnswerReward(tokenizer),
            args=AsyncGRPOConfig(
                output_dir=str(tmp_path),
                loss_type="m2po",
                off_policy_mask_threshold=0.5,
                per_device_train_batch_size=8,
                num_generations=4,
                bf16=False,
                report_to="none",
            ),  # fmt: skip
            train_dataset=dataset,
            processing_class=tokenizer,
        )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"m2po_threshold": 0.0}, "m2po_threshold"), ({"m2po_threshold": -1.0}, "m2po_threshold"),
     ({"m2po_variant": "clip"}, "m2po_variant"), ({"m2po_gamma": 0.0}, "m2po_gamma")],
)  # fmt: skip
def test_m2po_config_validation_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="m2po", bf16=False, report_to="none", **overrides)
