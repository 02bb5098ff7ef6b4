"""In-flight weight updates (`inflight_weight_updates=True`): the generation process loads newer weights between
decoding steps, every token records the version that sampled it, and μ stays that distribution's log-prob.

μ is checked against a recomputation written here: the model run one token at a time with a key/value cache, each
step on the weights the token recorded, the cache kept as the earlier weights computed it (as the generator keeps
it). Not against the backend's own numbers."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, TrainerCallback

from tests.support.trainer_utils import length_reward, load_model, make_args
from trl_async import AsyncGRPOTrainer
from trl_async.rollout.backends import BackendContext, HFBackend, ModelSpec
from trl_async.rollout.weights import SharedWeightStore, named_trainable_parameters


@torch.no_grad()
def chat_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def recompute_mu(models_by_version: dict, prompt: list[int], tokens: list[int], versions: list[int]) -> torch.Tensor:
    """log p(token_t) when the prompt's keys and values come from the weights of `versions[0]` and step t runs on the
    weights of `versions[t]`, reusing the cache of the earlier steps as it was computed (temperature 1)."""
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    logps = []
    model = models_by_version[versions[0]]
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
    for t, token in enumerate(tokens):
        logits = out.logits[0, -1].float()
        logps.append(torch.log_softmax(logits, -1)[token])
        if t + 1 == len(tokens):
            break
        model = models_by_version[versions[t + 1]]
        position = torch.tensor([[len(prompt) + t]])
        out = model(
            input_ids=torch.tensor([[token]]),
            attention_mask=torch.ones(1, len(prompt) + t + 1, dtype=torch.long),
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
    return torch.stack(logps)


def test_a_forced_mid_sequence_update_changes_the_distribution_exactly_at_the_recorded_token(tokenizer):
    v0 = load_model().eval()
    v1 = copy.deepcopy(v0)
    with torch.no_grad():  # another policy, clearly
        for layer in v1.model.layers:
            layer.mlp.down_proj.weight.add_(torch.randn_like(layer.mlp.down_proj.weight) * 0.05)
    store = SharedWeightStore(named_trainable_parameters(v0))
    store.publish(named_trainable_parameters(v0), version=0)
    switch_after = 5  # the update is published during step 5: step 6 on is sampled by v1
    calls = []

    def heartbeat():
        calls.append(len(calls))
        if len(calls) == switch_after + 1:
            store.publish(named_trainable_parameters(v1), version=1)

    config = GenerationConfig(do_sample=True, max_new_tokens=14, min_new_tokens=14, temperature=1.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    context = BackendContext(ModelSpec(config=v0.config, dtype=torch.float32), None, store, config, 1.0,
                             [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu", heartbeat=heartbeat)  # fmt: skip
    backend = HFBackend(context, inflight_weight_updates=True)
    assert backend.load() == 0
    prompts = [chat_prompt(tokenizer, f"What is {a}+{b}?") for a, b in ((12, 34), (56, 71))]
    assert len(prompts[0]) == len(prompts[1])  # no padding: the recomputation runs each row alone
    out = backend.generate(prompts, seed=0)
    versions = out.token_versions.tolist()
    expected = [0] * (switch_after + 1) + [1] * (14 - switch_after - 1)
    assert versions == [expected, expected]
    models = {0: v0, 1: v1}
    for row, prompt in enumerate(prompts):
        tokens = out.completion_ids[row].tolist()
        mu = out.importance_logprobs()[row]  # the trainer's parametrization (min_new_tokens masks EOS before sampling)
        torch.testing.assert_close(mu, recompute_mu(models, prompt, tokens, versions[row]), atol=2e-4, rtol=1e-4)
        # v0 alone reproduces μ up to the recorded switch, and not from there on.
        on_v0 = recompute_mu(models, prompt, tokens, [0] * len(tokens))
        torch.testing.assert_close(mu[: switch_after + 1], on_v0[: switch_after + 1], atol=2e-4, rtol=1e-4)
        assert (mu[switch_after + 1 :] - on_v0[switch_after + 1 :]).abs().max() > 1e-2


def test_without_inflight_updates_a_batch_keeps_its_weights(tokenizer):
    v0 = load_model().eval()
    store = SharedWeightStore(named_trainable_parameters(v0))
    store.publish(named_trainable_parameters(v0), version=0)
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        v1.lm_head.weight.mul_(1.5)

    def heartbeat():  # published mid-batch, but not loaded until the next batch
        store.publish(named_trainable_parameters(v1), version=1)

    config = GenerationConfig(do_sample=True, max_new_tokens=6, min_new_tokens=6,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    context = BackendContext(ModelSpec(config=v0.config, dtype=torch.float32), None, store, config, 1.0,
                             [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu", heartbeat=heartbeat)  # fmt: skip
    backend = HFBackend(context)
    backend.load()
    prompt = chat_prompt(tokenizer, "What is 1+2?")
    out = backend.generate([prompt], seed=0)
    assert out.token_versions.tolist() == [[0] * 6]
    torch.testing.assert_close(out.importance_logprobs()[0], recompute_mu({0: v0}, prompt, out.completion_ids[0].tolist(), [0] * 6),
                               atol=2e-4, rtol=1e-4)  # fmt: skip


# ----------------------------------------------------------------------------------------------- in training
class _VersionProbe(AsyncGRPOTrainer):
    """Keeps the weights of every version and two rows of every training batch; `check()`, after training (so that the
    run keeps its own timing), recomputes their μ under the versions their tokens recorded (`recompute_mu`): the
    held-out check that per-token versions are exact."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights = {}
        self.rows = []  # (trainer version, row's version, prompt, tokens, token versions, μ)

    def _compute_loss(self, model, inputs):
        current = self.state.global_step
        if current not in self.weights:
            unwrapped = self.accelerator.unwrap_model(self.model)
            self.weights[current] = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
        if self.model.training and "rollout_token_versions" in inputs:
            mask = inputs["completion_mask"].bool()
            for row in range(2):
                self.rows.append((
                    current,
                    int(inputs["rollout_versions"][row]),
                    inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist(),
                    inputs["completion_ids"][row][mask[row]].tolist(),
                    inputs["rollout_token_versions"][row][mask[row]].tolist(),
                    inputs["sampling_per_token_logps"][row][mask[row]].clone(),
                ))  # fmt: skip
        return super()._compute_loss(model, inputs)

    def check(self) -> list:
        models = {}
        for version, weights in self.weights.items():
            models[version] = load_model().eval()  # a plain model: the trainer's own is set up for training
            models[version].load_state_dict(weights)
        distinct = []
        for current, row_version, prompt, tokens, versions, mu in self.rows:
            torch.testing.assert_close(mu, recompute_mu(models, prompt, tokens, versions), atol=5e-4, rtol=1e-4)
            assert row_version == min(versions) == versions[0] and versions == sorted(versions)
            assert current - versions[0] <= self.args.max_staleness  # the oldest token bounds the row
            distinct.append(sorted(set(versions)))
        return distinct


def test_every_token_of_a_training_batch_records_the_weights_that_sampled_it(tmp_path, dataset, tokenizer):
    # Long forced completions on few rows: the trainer finishes a step while the next batch is still decoding, so
    # versions change mid-sequence.
    args = make_args(tmp_path, max_steps=8, per_device_train_batch_size=4, num_generations=2, max_completion_length=64,
                     generation_kwargs={"min_new_tokens": 64}, inflight_weight_updates=True, max_staleness=1,
                     trainer_generates_while_starting=False)  # fmt: skip
    trainer = _VersionProbe(model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer)  # fmt: skip
    trainer.train()
    distinct = trainer.check()
    assert len(distinct) == 2 * 8
    assert any(len(versions) > 1 for versions in distinct), distinct  # updates did land mid-sequence
    # Gated before their first token: no batch had to be evicted.
    assert sum(h.get("async/evicted", 0) for h in trainer.state.log_history) == 0
    token_ages = [h["offpolicy/token_age_mean"] for h in trainer.state.log_history if "offpolicy/token_age_mean" in h]
    row_ages = [h["offpolicy/row_age_mean"] for h in trainer.state.log_history if "offpolicy/row_age_mean" in h]
    assert all(t <= r for t, r in zip(token_ages, row_ages, strict=True)) and sum(token_ages) < sum(row_ages)


def test_at_staleness_zero_inflight_updates_change_nothing(tmp_path, dataset, tokenizer):
    """No update can land mid-sequence on-policy: the run equals the gate-only one, completion for completion."""
    runs = {}
    for inflight in (False, True):
        recorded = []

        class Recording(AsyncGRPOTrainer):
            def _compute_loss(self, model, inputs, recorded=recorded):
                if self.model.training:
                    recorded.append((inputs["completion_ids"].clone(), inputs.get("rollout_token_versions")))
                return super()._compute_loss(model, inputs)

        args = make_args(tmp_path / str(inflight), max_steps=4, max_staleness=0, inflight_weight_updates=inflight,
                         trainer_generates_while_starting=False)  # fmt: skip
        trainer = Recording(model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer)  # fmt: skip
        trainer.train()
        runs[inflight] = recorded
    for (ids_a, _), (ids_b, versions) in zip(runs[False], runs[True], strict=True):
        assert torch.equal(ids_a, ids_b)
        assert versions is not None and (versions == versions[:, :1]).all()


def test_inflight_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="fixed_staleness"):
        make_args(tmp_path, inflight_weight_updates=True, fixed_staleness=2)
    with pytest.raises(ValueError, match="hf"):
        make_args(tmp_path, inflight_weight_updates=True, generation_backend="vllm")


class _SlowStep(TrainerCallback):
    """Makes every optimizer step slower than a generation batch, so that the generator could run ahead."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.5)


def test_a_generator_ahead_of_the_trainer_waits_for_recent_weights_before_a_batch_starts(tmp_path, dataset, tokenizer):
    # Short completions and a slow trainer: the generator has room in the queue before weights recent enough for the
    # bound exist. The gate holds each batch before its first token (the oldest one) until they are published; a batch
    # started on the weights it happens to hold would be too old by the time it trains, and be evicted.
    args = make_args(tmp_path, max_steps=8, inflight_weight_updates=True, max_staleness=1,
                     trainer_generates_while_starting=False)  # fmt: skip
    trainer = AsyncGRPOTrainer(model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer)  # fmt: skip
    trainer.add_callback(_SlowStep())
    trainer.train()
    logs = trainer.state.log_history
    assert sum(h.get("async/evicted", 0) for h in logs) == 0
    assert max(h["async/staleness_max"] for h in logs if "async/staleness_max" in h) <= 1
