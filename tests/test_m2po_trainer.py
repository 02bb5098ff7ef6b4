"""loss_type="m2po" inside AsyncGRPOTrainer, on the bundled tiny model."""

import math

import pytest
import torch
from test_importance_trainer import make_batch
from trainer_utils import length_reward, load_model, make_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rewards import MathAnswerReward
from trl_async.toy import make_arithmetic_dataset, tiny_model_path


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


@pytest.mark.parametrize(
    "settings",
    [dict(m2po_rule="paper"), dict(m2po_rule="authors_code")],
    ids=["paper", "authors_code"],
)
def test_m2po_trains_with_finite_loss_and_metrics(tmp_path, tokenizer, dataset, settings):
    logged = train(tmp_path, tokenizer, dataset, trainer_generates_while_starting=False, **settings)
    assert len(logged) == 4
    for entry in logged:
        assert math.isfinite(entry["loss"])
        for key in ("m2po/masked_fraction", "m2po/m2_before", "m2po/m2_after", "m2po/all_masked_batches"):
            assert key in entry and math.isfinite(entry[key])
        assert entry["m2po/all_masked_batches"] == int(entry["m2po/all_masked_batches"])  # a count
    # Stale rows (staleness 1 after the first step, lr 1e-3) really diverge from the current policy.
    assert max(entry["m2po/m2_before"] for entry in logged[1:]) > 0
    if settings.get("m2po_rule") == "paper":
        # Algorithm 1 bounds the mean δ² of the trust-region tokens that remain.
        assert all(entry["m2po/m2_after_trust_region"] <= 0.04 + 1e-6 for entry in logged)


def test_m2po_on_synchronous_path_without_behaviour_logps_keeps_everything(tmp_path, tokenizer, dataset):
    """TRL's own generation (async off) returns no sampling log-probs and, aligned, no old_per_token_logps: the
    batch is on-policy, the ratio is 1 and nothing is masked."""
    logged = train(tmp_path, tokenizer, dataset, async_generation=False, max_steps=2)
    assert all(entry["m2po/masked_fraction"] == 0.0 for entry in logged)
    assert all(entry["m2po/m2_before"] == 0.0 for entry in logged)


def _algorithm_1_loss(logps, behaviour, advantages, mask, tau, normalizer):
    """Independent re-derivation of the paper's rule and objective, token by token in plain Python.

    Candidates: valid tokens whose ratio moves with the advantage. While the mean δ² over the remaining candidates
    exceeds τ, drop the largest δ² (lower flat index first on ties). J = (1/N) Σ_t M_t r_t A_t, loss = −J."""
    delta = (logps - behaviour).detach()
    rows, width = delta.shape
    candidates = [
        (float(delta[b, t]) ** 2, b * width + t)
        for b in range(rows)
        for t in range(width)
        if mask[b, t] and ((advantages[b] > 0 and delta[b, t] > 0) or (advantages[b] < 0 and delta[b, t] < 0))
    ]
    remaining = sorted(candidates, key=lambda c: (-c[0], c[1]))
    dropped = set()
    while remaining and sum(c[0] for c in remaining) / len(remaining) > tau:
        dropped.add(remaining.pop(0)[1])
    total = 0.0
    for b in range(rows):
        for t in range(width):
            if mask[b, t] and b * width + t not in dropped:
                total = total + torch.exp(logps[b, t] - behaviour[b, t]) * advantages[b]
    return -total / normalizer


@pytest.mark.parametrize(("accumulation", "steps_per_generation"), [(1, 1), (2, 2), (1, 2)])
def test_trainer_m2po_loss_equals_an_independent_computation(
    tmp_path, tokenizer, dataset, accumulation, steps_per_generation
):
    """The trainer's M2PO loss (and its gradients) on one micro-batch, against Algorithm 1 written out by hand with
    TRL dapo's normalizer: the valid tokens of the accumulation window, per process."""
    args = make_args(tmp_path, loss_type="m2po", max_staleness=1, gradient_accumulation_steps=accumulation,
                     steps_per_generation=steps_per_generation)  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    inputs, _ = make_batch(tokenizer, trainer.model, seed=3)
    # TRL's num_items_in_batch counts the whole generation batch: `steps_per_generation` micro-batches (of this size).
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum() * steps_per_generation
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    reference_model = load_model().train()
    mask = inputs["completion_mask"]
    logits = reference_model(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
    ).logits[:, inputs["prompt_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    # TRL dapo's normalizer: each micro-batch's token sum over the token count of the whole accumulation window
    # (here `accumulation` micro-batches of this size), so that the accumulated gradient is the window's mean.
    normalizer = float(mask.sum()) * accumulation
    expected = _algorithm_1_loss(
        logps, inputs["sampling_per_token_logps"], inputs["advantages"], mask, 0.04, normalizer
    )
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    expected.backward()
    for name, p in reference_model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    window = trainer._m2po_window["train"]
    assert 0 < window[1] < window[0]  # some tokens were masked: the rule really acted on this batch


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
     ({"m2po_rule": "aligned"}, "m2po_rule"), ({"m2po_scope": "rank"}, "m2po_scope"),
     ({"m2po_clip_floor_low": 0.3}, "m2po_clip_floor_low"),
     ({"m2po_rule": "authors_code", "m2po_clip_floor_low": 1.5}, "m2po_clip_floor_low"),
     ({"m2po_scope": "global", "gradient_accumulation_steps": 2}, "gradient_accumulation_steps")],
)  # fmt: skip
def test_m2po_config_validation_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="m2po", bf16=False, report_to="none", **overrides)
