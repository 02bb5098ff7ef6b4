"""AsyncPPOTrainer end to end on the bundled tiny model: real generation processes, real forward passes.

The reference computations here do not reuse the trainer's code: log-probs come from the models' plain forward
(full logits), values from the value model's own sequence-classification forward on every prefix, scores from the
reward function on the decoded text, and the PPO formulas from `trl_async.algorithms.ppo` (tested on its own against loops
in tests/test_ppo_math.py).
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, TrainerCallback
from trl import GRPOConfig

from tests.support.trainer_utils import load_model, load_tokenizer, make_args, pid_is_gone
from trl_async import AsyncPPOConfig, AsyncPPOTrainer
from trl_async.algorithms.ppo import (
    explained_variance,
    gae,
    kl_shaped_rewards,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)
from trl_async.rewards import MathAnswerReward
from trl_async.rollout.pipeline import publishable_parameters
from trl_async.toy import make_arithmetic_dataset, tiny_model_path
from trl_async.trainers.critic import CRITIC_ADAPTER, CRITIC_FILE, AdapterValueModel, PerTokenValueModel

PPO_METRICS = (
    "ppo/value_loss", "ppo/explained_variance", "ppo/approx_kl", "ppo/clipfrac", "ppo/returns_mean",
    "ppo/value_mean", "ppo/value_clipfrac", "ppo/policy_loss", "objective/kl", "objective/scores",
)  # fmt: skip
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ppo_two_ranks.py")


def ppo_args(tmp_path, **overrides):
    kwargs = dict(num_generations=1, max_completion_length=12, gradient_checkpointing=False)
    kwargs.update(overrides)
    return make_args(tmp_path, config_cls=AsyncPPOConfig, **kwargs)


def digit_reward(completions, **kwargs):
    """A text reward that depends on the completion only: the share of digits among its characters."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ----------------------------------------------------------------------------------------------------- config
def test_public_names_and_single_generation():
    import trl_async

    assert trl_async.AsyncPPOTrainer is AsyncPPOTrainer and trl_async.AsyncPPOConfig is AsyncPPOConfig
    with pytest.raises(ValueError, match="at least 2 generations"):  # TRL's GRPOConfig refuses it ...
        GRPOConfig("unused", num_generations=1, report_to="none", bf16=False)
    config = AsyncPPOConfig("unused", report_to="none", bf16=False, per_device_train_batch_size=3)
    assert config.num_generations == 1 and type(config.num_generations) is int  # ... PPO's default is 1
    assert config.generation_batch_size == 3 and config.loss_type == "ppo"
    # TRL's former PPOConfig defaults, and kl_coef drives TRL's reference computation.
    assert (config.vf_coef, config.cliprange, config.cliprange_value, config.gamma, config.lam) == (
        0.1, 0.2, 0.2, 1.0, 0.95,
    )  # fmt: skip
    assert (config.kl_coef, config.beta, config.kl_estimator, config.whiten_rewards) == (0.05, 0.05, "k1", False)
    assert config.whiten_advantages and config.missing_eos_penalty is None
    # An odd generation batch with one generation per prompt: divisibility is checked against 1, not 2.
    assert AsyncPPOConfig("unused", report_to="none", bf16=False, per_device_train_batch_size=5).num_generations == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"vf_coef": -0.1}, "vf_coef"),
        ({"cliprange": 0.0}, "cliprange"),
        ({"cliprange_value": -1.0}, "cliprange_value"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"kl_coef": -0.01}, "kl_coef"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
        ({"missing_eos_penalty": -1.0}, "missing_eos_penalty"),
        ({"critic_learning_rate": 0.0}, "critic_learning_rate"),
        ({"loss_type": "dapo"}, "loss_type"),
        ({"beta": 0.3}, "beta"),
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"epsilon_high": 0.3}, "epsilon_high"),
        ({"max_staleness": -1}, "max_staleness"),  # the engine's own validation still runs
    ],
)
def test_config_validation_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        ppo_args(tmp_path, **overrides)


def test_trainer_refuses_grpo_config_and_tools(tmp_path, dataset, tokenizer):
    with pytest.raises(TypeError, match="AsyncPPOConfig"):
        AsyncPPOTrainer(model=load_model(), reward_funcs=digit_reward, args=make_args(tmp_path),
                        train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="tools"):
        AsyncPPOTrainer(model=load_model(), reward_funcs=digit_reward, args=ppo_args(tmp_path),
                        train_dataset=dataset, processing_class=tokenizer, tools=[len])  # fmt: skip


# ------------------------------------------------------------------------------------------- same formulas
def _plain_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """log π(y_t | ·) from the model's ordinary forward (full logits), not the trainer's fused head."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    positions = logits[:, prompt_ids.size(1) - 1 : -1] / temperature
    return torch.log_softmax(positions.float(), dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def _prefix_values(value_model, prompt_ids, prompt_mask, completion_ids):
    """V(s_t) as the sequence-classification model itself scores the prefix (prompt, y_<t): its own forward and its
    own pooling (the last non-padding token), one forward per t."""
    columns = []
    with torch.no_grad():
        for t in range(completion_ids.size(1)):
            ids = torch.cat([prompt_ids, completion_ids[:, :t]], dim=1)
            mask = torch.cat([prompt_mask, torch.ones_like(completion_ids[:, :t])], dim=1)
            columns.append(value_model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float())
    return torch.stack(columns, dim=1)


def test_on_policy_batch_and_loss_equal_ppo_math_on_independent_tensors(tmp_path, dataset, tokenizer):
    """At max_staleness=0 the rows come from the generation process at version 0. On those rows, the trainer's
    targets and loss equal PPO's formulas (ppo_math) applied to tensors computed here independently."""
    torch.manual_seed(0)
    policy = load_model()
    with torch.no_grad():  # the reference (TRL builds it from the checkpoint on disk) then differs: KL != 0
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    torch.nn.init.normal_(value_model.score.weight, std=0.3)  # values far from 0, different per state
    value_model.config.pad_token_id = tokenizer.pad_token_id
    reference_values = copy.deepcopy(value_model).eval()
    args = ppo_args(
        tmp_path, max_staleness=0, max_steps=1, kl_coef=0.1, gamma=0.9, lam=0.8, whiten_rewards=True,
        whiten_advantages=False, missing_eos_penalty=0.5, max_completion_length=20, per_device_train_batch_size=8,
    )  # fmt: skip
    trainer = AsyncPPOTrainer(
        model=policy, reward_funcs=digit_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        value_model=value_model,
    )  # fmt: skip
    trainer.model.train()
    try:
        batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    finally:
        trainer.close_rollout()
    assert (batch["rollout_versions"] == 0).all()
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    mask = completion_mask.bool()
    assert mask.any(dim=1).all()

    # Scores: the reward on the decoded text, minus the penalty for rows whose last valid token is not an EOS.
    lengths = completion_mask.sum(dim=1).tolist()
    texts = [
        tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(completion_ids, lengths, strict=True)
    ]
    scores = torch.tensor(digit_reward([[{"content": text}] for text in texts]))
    no_eos = torch.tensor(
        [row[n - 1].item() != tokenizer.eos_token_id for row, n in zip(completion_ids, lengths, strict=True)]
    )
    assert no_eos.any() and not no_eos.all(), "the test wants rows with and without EOS"
    scores = scores - 0.5 * no_eos.float()

    temperature = args.temperature
    old_logps = _plain_logps(trainer.model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)
    ref_logps = _plain_logps(load_model(), prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)
    values = _prefix_values(reference_values, prompt_ids, prompt_mask, completion_ids)
    # The generator sampled with the same weights: its behaviour log-probs are π_old's.
    torch.testing.assert_close(batch["sampling_per_token_logps"][mask], old_logps[mask], atol=2e-4, rtol=0)

    shaped = kl_shaped_rewards(scores, old_logps, ref_logps, mask, kl_coef=0.1, kl_estimator="k1")
    assert shaped.kl[mask].abs().max() > 1e-3
    rewards = masked_whiten(shaped.rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for key, expected in [("old_per_token_logps", old_logps), ("old_values", values), ("advantages", advantages),
                          ("returns", returns)]:  # fmt: skip
        torch.testing.assert_close(batch[key][mask], expected[mask], atol=1e-4, rtol=1e-4, msg=key)

    trainer._reduce_statistics("train")  # what the end of a logging step does (on every rank)
    trainer.log({})
    metrics = trainer.state.log_history[-1]
    assert metrics["ppo/explained_variance"] == pytest.approx(
        explained_variance(values, returns, mask).item(), abs=1e-4
    )
    assert metrics["ppo/returns_mean"] == pytest.approx(returns[mask].mean().item(), abs=1e-5)
    assert metrics["ppo/value_mean"] == pytest.approx(values[mask].mean().item(), abs=1e-5)
    assert metrics["objective/kl"] == pytest.approx(shaped.kl.sum(dim=1).mean().item(), abs=1e-5)
    assert metrics["objective/scores"] == pytest.approx(scores.mean().item(), abs=1e-6)

    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we do not run here
    loss = trainer._compute_loss(trainer.model, batch)
    # Same weights as at batch time: π_θ = π_old and V = V_old, so the loss is PPO's at ratio 1.
    expected = (
        ppo_policy_loss(old_logps, old_logps, advantages, mask, cliprange=0.2).loss
        + 0.1 * value_loss(values, values, returns, mask, cliprange_value=0.2).loss
    )
    assert abs(expected.item()) > 1e-3
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
    # The loss's gradient reaches both the policy and the critic.
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
    assert trainer.critic_model.model.score.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- stale, reused batch
class _KeepPolicyAndCritic(TrainerCallback):
    """The policy's and the critic's weights at every version (optimizer step), keyed by the version."""

    def __init__(self, trainer):
        self.trainer = trainer

    def keep(self, step):
        trainer = self.trainer
        policy = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        critic = trainer.critic_model.model.state_dict()
        trainer.policy_by_version[step] = {k: v.detach().clone() for k, v in policy.items()}
        trainer.critic_by_version[step] = {k: v.detach().clone() for k, v in critic.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.keep(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.keep(state.global_step)


class _LossRecordingPPOTrainer(AsyncPPOTrainer):
    """Records what the trainer used: the version at which each rollout batch entered training (π_old, V_old), and
    for every training loss the version, the batch dict it was given and the loss it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy_by_version, self.critic_by_version = {}, {}
        self.batch_versions: list[int] = []
        self.loss_calls: list[tuple[int, dict, torch.Tensor]] = []
        self.add_callback(_KeepPolicyAndCritic(self))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.batch_versions.append(self.state.global_step)
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            given = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            self.loss_calls.append((self.state.global_step, given, loss.detach().clone()))
        return loss


def _with_weights(model, weights):
    model = copy.deepcopy(model)
    model.load_state_dict(weights)
    return model.eval()


def _independent_ppo_targets(scores, old_logps, ref_logps, old_values, mask, kl_coef, gamma, lam):
    """PPO's targets written out token by token (Ziegler et al. 2019 reward, Schulman et al. 2016 GAE), in float64:
    r_t = -kl_coef (log π_old - log π_ref) + score on the last valid token; A_t = δ_t + γλ A_{t+1} with
    δ_t = r_t + γ V_{t+1} - V_t and V = 0 after the last valid token; R_t = A_t + V_t; then A whitened over every
    valid token of the batch with the unbiased variance and eps 1e-8 (TRL's former masked_whiten)."""
    rows, width = mask.shape
    advantages = torch.zeros(rows, width, dtype=torch.float64)
    returns = torch.zeros(rows, width, dtype=torch.float64)
    for b in range(rows):
        n = int(mask[b].sum())
        running = 0.0
        for t in reversed(range(n)):
            reward = -kl_coef * (float(old_logps[b, t]) - float(ref_logps[b, t])) + (
                float(scores[b]) if t == n - 1 else 0.0
            )
            next_value = float(old_values[b, t + 1]) if t + 1 < n else 0.0
            delta = reward + gamma * next_value - float(old_values[b, t])
            running = delta + gamma * lam * running
            advantages[b, t] = running
            returns[b, t] = running + float(old_values[b, t])
    flat = [float(advantages[b, t]) for b in range(rows) for t in range(width) if mask[b, t]]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
    whitened = torch.where(mask, (advantages - mean) / math.sqrt(var + 1e-8), torch.zeros((), dtype=torch.float64))
    return whitened, returns


def _independent_ppo_loss(logps, old_logps, behaviour, advantages, values, old_values, returns, mask, *, cliprange,
                          cliprange_value, vf_coef, is_cap, normalizer):  # fmt: skip
    """PPO-clip with TRL's `sequence_mask` weight, plus the clipped value loss, token by token:

    w_b = exp(Σ_t log π_old - log μ) over row b's valid tokens, and 0 where it exceeds `is_cap`;
    ℓ_t = w_b max(-A_t ρ_t, -A_t clip(ρ_t, 1 ± ε)), ρ_t = π_θ/π_old;
    ℓ^V_t = ½ max((V_t - R_t)², (clip(V_t, V_old,t ± c) - R_t)²);
    loss = (Σ ℓ_t + vf_coef Σ ℓ^V_t) / N. Returns (loss, the rows' ratios π_old/μ before the cap, tokens where the
    value clip was active)."""
    rows, width = mask.shape
    policy = value = 0.0
    ratios, value_clip_active = [], 0
    for b in range(rows):
        ratios.append(
            math.exp(sum(float(old_logps[b, t]) - float(behaviour[b, t]) for t in range(width) if mask[b, t]))
        )
        weight = 0.0 if ratios[-1] > is_cap else ratios[-1]
        for t in range(width):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logps[b, t]) - float(old_logps[b, t]))
            a = float(advantages[b, t])
            policy += weight * max(-a * ratio, -a * min(max(ratio, 1 - cliprange), 1 + cliprange))
            v, v_old, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            clipped = min(max(v, v_old - cliprange_value), v_old + cliprange_value)
            value += 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
            value_clip_active += (clipped - r) ** 2 > (v - r) ** 2
    return (policy + vf_coef * value) / normalizer, ratios, value_clip_active


class _Probes:
    """Plain forwards of a version's weights: the policy's log-probs (full logits) and the critic's values (its own
    sequence-classification forward on every prefix), in float64."""

    def __init__(self, policy, critic, temperature):
        self.policy, self.critic, self.temperature = policy, critic, temperature

    def logps(self, weights, batch):
        model = _with_weights(self.policy, weights)
        ids = [batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
        return _plain_logps(model, *ids, self.temperature).double()

    def values(self, weights, batch):
        model = _with_weights(self.critic, weights)
        return _prefix_values(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"]).double()


def test_stale_batch_reused_across_steps_gives_ppo_targets_and_loss_computed_independently(
    tmp_path, dataset, tokenizer
):
    """A batch the generation process sampled with older weights than π_old, trained on over two optimizer steps
    (num_iterations=2): at its second use π_θ != π_old and V != V_old. The trainer's batch dict (π_old, V_old, whitened
    advantages, returns) and both losses equal PPO written out here, token by token, from plain forwards of the
    weights each version really had: the importance weight π_old/μ (TRL's sequence_mask, cap 3), the value clip
    around the OLD values, the whitening of the advantages.

    weight_sync_steps=3 publishes v0, v3, ...: batch 1 (first used at v2) is always generated by v0, whatever the
    timing."""
    torch.manual_seed(0)
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    torch.nn.init.normal_(value_model.score.weight, std=0.3)  # values far from 0, different per state
    value_model.config.pad_token_id = tokenizer.pad_token_id
    critic_probe = copy.deepcopy(value_model)
    policy_probe, reference = load_model(), load_model()
    args = ppo_args(
        tmp_path, max_steps=4, num_iterations=2, max_staleness=3, weight_sync_steps=3,
        trainer_generates_while_starting=False, learning_rate=6e-4, critic_learning_rate=3e-3, kl_coef=0.1,
        gamma=0.9, lam=0.8, cliprange_value=0.05, per_device_train_batch_size=16, max_completion_length=16,
    )  # fmt: skip
    assert args.whiten_advantages and args.vllm_importance_sampling_mode == "sequence_mask"
    assert args.vllm_importance_sampling_clip_max == 3.0 and args.vllm_importance_sampling_correction
    trainer = _LossRecordingPPOTrainer(
        model=load_model(), reward_funcs=digit_reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        value_model=value_model,
    )  # fmt: skip
    trainer.train()
    assert trainer.batch_versions == [0, 2]
    assert [version for version, _, _ in trainer.loss_calls] == [0, 1, 2, 3]
    probes = _Probes(policy_probe, critic_probe, args.temperature)
    checked_clip = 0
    for version, batch, loss in trainer.loss_calls[2:]:
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        mask = completion_mask.bool()
        # Staleness measured from the weights: μ is v0's, π_old is v2's, and they differ.
        behaviour = batch["sampling_per_token_logps"].double()
        torch.testing.assert_close(behaviour[mask], probes.logps(trainer.policy_by_version[0], batch)[mask], atol=2e-4,
                                   rtol=0)  # fmt: skip
        old_logps = probes.logps(trainer.policy_by_version[2], batch)
        assert (old_logps - behaviour)[mask].abs().max() > 0.05
        ref_logps = probes.logps(reference.state_dict(), batch)
        old_values = probes.values(trainer.critic_by_version[2], batch)

        lengths = completion_mask.sum(dim=1).tolist()
        texts = [
            tokenizer.decode(r[:n], skip_special_tokens=True) for r, n in zip(completion_ids, lengths, strict=True)
        ]
        scores = torch.tensor(digit_reward([[{"content": text}] for text in texts]), dtype=torch.float64)
        advantages, returns = _independent_ppo_targets(
            scores, old_logps, ref_logps, old_values, mask, kl_coef=0.1, gamma=0.9, lam=0.8
        )
        for key, expected in [("old_per_token_logps", old_logps), ("old_values", old_values),
                              ("advantages", advantages), ("returns", returns)]:  # fmt: skip
            torch.testing.assert_close(batch[key].double()[mask], expected[mask], atol=2e-4, rtol=1e-4, msg=key)

        logps, values = (
            probes.logps(trainer.policy_by_version[version], batch),
            probes.values(trainer.critic_by_version[version], batch),
        )
        expected, ratios, value_clip_active = _independent_ppo_loss(
            logps, old_logps, behaviour, advantages, values, old_values, returns, mask, cliprange=0.2,
            cliprange_value=0.05, vf_coef=0.1, is_cap=3.0, normalizer=float(completion_mask.sum()),
        )  # fmt: skip
        assert loss.item() == pytest.approx(expected, rel=1e-4, abs=1e-5), version
        # The weight acts: rows weighted below and above 1, and a row past the cap (masked), none near the cap.
        assert any(r < 0.9 for r in ratios) and any(1.1 < r < 2.9 for r in ratios), ratios
        assert any(r > 3.1 for r in ratios) and not any(2.9 <= r <= 3.1 for r in ratios), ratios
        if version == 3:  # the second use: π_θ moved away from π_old and V from V_old
            assert (logps - old_logps)[mask].abs().max() > 1e-3 and (values - old_values)[mask].abs().max() > 0.05
            checked_clip += value_clip_active
    assert checked_clip > 0, "the value clip was never active at the second use: the test would not see it"


# ------------------------------------------------------------------------------------------- checkpoints
class _CriticSnapshots(TrainerCallback):
    """The critic's tensors when training begins (after a checkpoint is loaded) and after every optimizer step, and
    the completions trained on per step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(self):
        return {k: v.detach().clone() for k, v in self.trainer.critic_model.checkpoint_tensors().items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = self.snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = self.snapshot()


def _ppo_trainer_with_snapshots(tmp_path, dataset, tokenizer, **overrides):
    trainer = AsyncPPOTrainer(
        model=load_model(), reward_funcs=MathAnswerReward(tokenizer), args=ppo_args(tmp_path, **overrides),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    snapshots = _CriticSnapshots(trainer)
    trainer.add_callback(snapshots)
    return trainer, snapshots


def test_save_and_resume_restore_the_critic_exactly(tmp_path, dataset, tokenizer):
    """3 steps, a checkpoint, 3 resumed steps equal 6 straight steps at max_staleness=0: the critic is restored
    bit for bit, and with it (and its optimizer state) the resumed run continues the straight one."""
    common = dict(max_staleness=0, max_steps=6, save_strategy="steps", save_steps=3, seed=3, learning_rate=3e-4,
                  max_completion_length=20)  # fmt: skip
    straight, straight_critic = _ppo_trainer_with_snapshots(tmp_path / "straight", dataset, tokenizer, **common)
    straight.train()
    checkpoint = tmp_path / "straight" / "out" / "checkpoint-3"
    assert (checkpoint / CRITIC_FILE).exists() and (checkpoint / "trl_async_rollout.json").exists()
    saved = load_file(str(checkpoint / CRITIC_FILE))
    assert saved.keys() == straight_critic.by_step[3].keys()
    assert all(torch.equal(saved[k], straight_critic.by_step[3][k]) for k in saved)
    assert straight_critic.by_step[3]["model.score.weight"].abs().sum() > 0  # the head left its zero init

    resumed, resumed_critic = _ppo_trainer_with_snapshots(tmp_path / "resumed", dataset, tokenizer, **common)
    fresh = resumed.critic_model.checkpoint_tensors()["model.score.weight"].detach().clone()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    restored = resumed_critic.by_step[3]
    assert all(torch.equal(restored[k], straight_critic.by_step[3][k]) for k in restored)
    assert not torch.equal(restored["model.score.weight"], fresh)
    assert sorted(resumed_critic.by_step) == [3, 4, 5, 6]
    for step in (4, 5, 6):
        for key, tensor in resumed_critic.by_step[step].items():
            torch.testing.assert_close(tensor, straight_critic.by_step[step][key], atol=1e-6, rtol=1e-5, msg=key)
    losses = {h["step"]: h["loss"] for h in straight.state.log_history if "loss" in h and "train_runtime" not in h}
    resumed_losses = {
        h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h and "train_runtime" not in h
    }
    for step in (4, 5, 6):
        assert resumed_losses[step] == pytest.approx(losses[step], rel=1e-4, abs=1e-6), step


# ------------------------------------------------------------------------------------------- PEFT critic
def test_peft_critic_is_an_adapter_on_the_shared_base_and_is_never_published(tmp_path, dataset, tokenizer):
    from peft import LoraConfig

    args = ppo_args(tmp_path, max_staleness=1, max_steps=3, learning_rate=5e-3, trainer_generates_while_starting=False,
                    save_strategy="steps", save_steps=3)  # fmt: skip
    trainer = AsyncPPOTrainer(
        model=load_model(), reward_funcs=digit_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    critic = trainer.critic_model
    assert isinstance(critic, AdapterValueModel)
    hidden = trainer.model.config.hidden_size
    assert sum(p.numel() for p in critic.parameters()) == hidden + 1  # the head: no second copy of the base
    names = dict(trainer.model.named_parameters())
    base_before = {n: p.detach().clone() for n, p in names.items() if "lora_" not in n}
    policy_adapter = {n: p.detach().clone() for n, p in names.items() if ".default." in n}
    critic_adapter = {n: p.detach().clone() for n, p in critic.adapter_parameters()}
    assert policy_adapter and critic_adapter
    published = []
    original = trainer._rollout.publish

    def spy(model, version, state=None):
        published.append(list(trainer._rollout.trainable_store.buffers))
        return original(model, version, state)

    trainer._rollout.publish = spy
    frozen, trainable = publishable_parameters(trainer.model)
    assert [n for n, _ in trainable] == list(policy_adapter)
    assert not any(f".{CRITIC_ADAPTER}." in n for n, _ in frozen)
    trainer.train()
    assert published and all(names_ == list(policy_adapter) for names_ in published)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base_before.items())  # the shared base stays frozen
    assert any(not torch.equal(after[n], p) for n, p in policy_adapter.items())
    assert any(not torch.equal(after[n], p) for n, p in critic_adapter.items())
    assert critic.head.weight.abs().sum() > 0
    assert all(p.requires_grad for _, p in critic.adapter_parameters())
    assert all(math.isfinite(v) for v in logged(trainer, "objective/kl"))  # the reference is the disabled adapter
    saved = load_file(str(tmp_path / "out" / "checkpoint-3" / CRITIC_FILE))
    assert {"head.weight", "head.bias"} <= saved.keys()
    assert {k.removeprefix("adapter.") for k in saved if k.startswith("adapter.")} == set(critic_adapter)


# ------------------------------------------------------------------------------------------- modes
@pytest.mark.parametrize(
    "overrides",
    [{"async_generation": False}, {"loss_type": "m2po", "max_staleness": 1, "gradient_checkpointing": True}],
    ids=["synchronous", "m2po-async"],
)
def test_trains_policy_and_critic_and_logs_ppo_metrics(tmp_path, dataset, tokenizer, overrides):
    """Two training steps, and the values PPO's definitions fix for the logged metrics: the new value head is zero,
    so at step 1 V = 0 (value mean 0, explained variance 1 - Var[R]/Var[R] = 0) and π_old is the reference (KL 0);
    every batch is trained on within one optimizer step at the weights that scored it, so ρ = 1 and V = V_old (clip
    fractions and approximate KL 0), and with ρ = 1 PPO's policy loss is minus the mean of the whitened advantages, 0.
    At step 2 the policy and the critic have moved: KL and the value mean are no longer 0."""
    trainer = AsyncPPOTrainer(
        model=load_model(), reward_funcs=digit_reward,
        args=ppo_args(tmp_path, max_steps=2, learning_rate=3e-4, per_device_eval_batch_size=8, **overrides),
        train_dataset=dataset, eval_dataset=dataset.select(range(8)), processing_class=tokenizer,
    )  # fmt: skip
    assert isinstance(trainer.critic_model, PerTokenValueModel)
    policy_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    critic_before = {n: p.detach().clone() for n, p in trainer.critic_model.named_parameters()}
    trainer.train()
    for key in PPO_METRICS:
        values = logged(trainer, key)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), key
    assert any(not torch.equal(p, policy_before[n]) for n, p in trainer.model.named_parameters())
    assert any(not torch.equal(p, critic_before[n]) for n, p in trainer.critic_model.named_parameters())
    first, second = (h for h in trainer.state.log_history if "ppo/value_mean" in h)
    assert first["ppo/value_mean"] == 0.0 and first["ppo/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert first["objective/kl"] == pytest.approx(0.0, abs=1e-6) and first["ppo/returns_mean"] != 0.0
    assert abs(second["objective/kl"]) > 1e-5 and abs(second["ppo/value_mean"]) > 1e-5  # (k1 may be negative)
    for entry in (first, second):
        assert entry["ppo/clipfrac"] == 0.0 and entry["ppo/value_clipfrac"] == 0.0
        assert entry["ppo/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    if overrides.get("async_generation") is False:
        assert not trainer._rollout.started and not logged(trainer, "async/staleness_mean")
        for entry in (first, second):
            assert entry["ppo/policy_loss"] == pytest.approx(0.0, abs=1e-6)
        evaluation = trainer.evaluate()  # TRL's evaluation loop: synchronous generation, the same PPO loss
        # The same identities on the evaluation batch: ρ = 1, so the loss is vf_coef times the value loss alone.
        assert evaluation["eval_ppo/clipfrac"] == 0.0 and evaluation["eval_ppo/policy_loss"] == pytest.approx(
            0.0, abs=1e-6
        )
        assert evaluation["eval_ppo/value_loss"] > 0
        assert evaluation["eval_loss"] == pytest.approx(0.1 * evaluation["eval_ppo/value_loss"], rel=1e-4, abs=1e-7)
    else:
        # Step 1's batch was sampled by the weights that train on it (μ = π_θ up to the generator's numerics): M2PO's
        # ratio is 1, nothing is masked, and its loss is minus the mean whitened advantage, 0.
        assert first["m2po/masked_fraction"] == 0.0 and first["m2po/m2_before"] < 1e-6
        assert first["ppo/policy_loss"] == pytest.approx(0.0, abs=1e-3)
        assert logged(trainer, "async/staleness_mean")


# ------------------------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("critic", ["value_model", "peft"])
def test_accelerate_launch_two_cpu_processes(tmp_path, critic):
    """Two ranks under a real `accelerate launch`, each with its own generator: DDP keeps the policy and the critic
    (a value model, or the PEFT critic adapter in the policy and its head) identical across ranks, and the batch
    metrics (all-reduced) are the same on both."""
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.run(
        [*launcher, SCRIPT, str(tmp_path), critic], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [r["process_index"] for r in ranks] == [0, 1] and all(r["num_processes"] == 2 for r in ranks)
    assert all(r["backend"] == "gloo" for r in ranks)
    assert ranks[0]["generator_pid"] != ranks[1]["generator_pid"]
    assert ranks[0]["rows_per_step"] == ranks[1]["rows_per_step"] == [8] * 3
    for key in ("policy_checksum", "critic_checksum"):
        assert ranks[0][key] == pytest.approx(ranks[1][key], rel=1e-9), key
        assert ranks[0][key] != pytest.approx(ranks[0][f"initial_{key}"], rel=1e-9), key
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    assert all(len(ranks[0]["metrics"][key]) == 3 for key in PPO_METRICS)
    for rank in ranks:
        assert pid_is_gone(rank["generator_pid"])


# ------------------------------------------------------------------------------------------- the bar (slow)
# The settings of docs/ppo.md ("Trainer"), recipes/configs/tiny_ppo.yaml and benchmarks/bench_ppo_vs_grpo.py, with the
# schedule pinned by `fixed_staleness=1`. A batch is a function of its weights, its prompts and its seed, so a run is a
# function of which weights version sampled each batch. Under the free schedule (`max_staleness=1`) that depends on
# the machine's load at start-up: a loaded machine has the trainer make the first four batches itself, a quiet one only
# the first. Seed 0 gives two runs, one per schedule, and they end apart: reward gain +0.216, or -0.030 where
# objective/kl grows from ~1.5 to ~20 after step 105 and the KL-shaped reward outweighs the score (docs/ppo.md,
# "Run to run"). A fresh CI machine drew the second one. Pinned, the run is the same on every machine and under any
# load, and it still trains on batches of the generation process, one version stale, corrected against μ.
BAR_STEPS = 150


@pytest.fixture(scope="module")
def bar_run(tmp_path_factory):
    tokenizer = load_tokenizer()
    args = AsyncPPOConfig(
        output_dir=str(tmp_path_factory.mktemp("ppo_bar")), max_steps=BAR_STEPS, per_device_train_batch_size=64,
        max_completion_length=32, temperature=0.7, learning_rate=1e-4, critic_learning_rate=1e-3,
        lr_scheduler_type="constant", fixed_staleness=1, gradient_checkpointing=False, logging_steps=1,
        report_to="none", save_strategy="no", bf16=False, seed=0,
    )  # fmt: skip
    trainer = AsyncPPOTrainer(
        model=tiny_model_path(), reward_funcs=MathAnswerReward(tokenizer), args=args,
        train_dataset=make_arithmetic_dataset(num_train=4000, num_test=8, seed=0)["train"], processing_class=tokenizer,
    )  # fmt: skip
    output = trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == BAR_STEPS
    # The pinned schedule: the first batch sampled by the initial weights, every later one exactly one version stale,
    # all from the generation process.
    assert [h["async/staleness_max"] for h in history] == [0.0] + [1.0] * (BAR_STEPS - 1)
    assert not any(h["async/trainer_generated_batches"] for h in history)
    return {
        "seconds": output.metrics["train_runtime"],
        "reward": [h["reward"] for h in history],
        "explained_variance": [h["ppo/explained_variance"] for h in history],
    }


@pytest.mark.slow
def test_tiny_arithmetic_reward_rises(bar_run):
    reward, quarter = bar_run["reward"], BAR_STEPS // 4
    gain = sum(reward[-quarter:]) / quarter - sum(reward[:quarter]) / quarter
    assert gain >= 0.1, f"reward gain (last quarter - first quarter) {gain:.3f}; rewards {[round(r, 2) for r in reward]}"
    # The 5-minute half of the bar is measured by benchmarks/bench_ppo_vs_grpo.py (seconds per run), not asserted:
    # tests carry no timed assertions.


@pytest.mark.slow
def test_tiny_arithmetic_explained_variance_rises(bar_run):
    ev, quarter = bar_run["explained_variance"], BAR_STEPS // 4
    start, end = sum(ev[:10]) / 10, sum(ev[-quarter:]) / quarter
    assert start <= 0.1, f"explained variance over the first 10 steps {start:.3f}"
    assert end >= 0.3, f"explained variance over the last quarter {end:.3f}"
