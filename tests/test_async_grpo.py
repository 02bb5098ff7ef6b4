"""AsyncGRPOTrainer end to end on the bundled tiny model: real generator processes, real forward passes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.assets import tiny_model_path
from trl_async.data import make_arithmetic_dataset
from trl_async.rollout import GeneratorError

# The keys of TRL 1.16's batch dict for text-only GRPO; see `test_batch_dict_contract_matches_trl`.
TRL_BATCH_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}
OUR_EXTRA_KEYS = {"sampling_per_token_logps", "rollout_versions"}


def answer_reward(completions, answer, **kwargs):
    """A text reward as TRL's docs write them: 1.0 when the text after '####' is the answer."""
    return [
        float(c[0]["content"].rsplit("####", 1)[-1].strip() == a) for c, a in zip(completions, answer, strict=True)
    ]


def length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 50.0 for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=256, num_test=8, seed=1)["train"]


def load_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


def make_args(tmp_path, config_cls=AsyncGRPOConfig, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(pid, 0); it is gone for our purposes only once reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


class InstrumentedTrainer(AsyncGRPOTrainer):
    """Records, for every batch that enters a loss, the staleness of its rows and whether the generator's
    behaviour log-probs equal the trainer's own log-probs of the same tokens."""

    def _compute_loss(self, model, inputs):
        staleness = self.state.global_step - inputs["rollout_versions"]
        self.recorded_staleness = getattr(self, "recorded_staleness", []) + staleness.tolist()
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )
        mask = inputs["completion_mask"].bool()
        gap = (logps - inputs["sampling_per_token_logps"]).abs()[mask].max().item()
        self.recorded_logp_gaps = getattr(self, "recorded_logp_gaps", []) + [(staleness.max().item(), gap)]
        return super()._compute_loss(model, inputs)


def test_plain_grpo_config_runs_async_with_defaults(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, config_cls=GRPOConfig)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    assert trainer.args.async_generation and trainer.args.max_staleness == 1
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 3
    for key in ("async/staleness_mean", "async/evicted", "async/queue_size", "async/generator_wait_s",
                "async/trainer_wait_s", "async/staleness_max", "completions/mean_length"):  # fmt: skip
        assert key in logged[-1], key
    assert all(h["async/staleness_max"] <= 1 for h in logged)
    assert logged[-1]["async/evicted"] == 0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_row_older_than_max_staleness_reaches_the_loss(tmp_path, dataset, tokenizer, max_staleness):
    args = make_args(tmp_path, max_staleness=max_staleness, max_steps=6, loss_type="m2po")
    trainer = InstrumentedTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert len(trainer.recorded_staleness) == 6 * 8
    assert max(trainer.recorded_staleness) <= max_staleness
    # The bound is exercised: the generator did run ahead, so stale rows did reach the loss.
    assert max(trainer.recorded_staleness) >= 1
    # Rows generated with the trainer's current weights have the trainer's log-probs: weights really flow back,
    # and behaviour log-probs use the same temperature scaling (the recipe default temperature 1.0 here).
    fresh_gaps = [gap for staleness, gap in trainer.recorded_logp_gaps if staleness == 0]
    assert fresh_gaps and max(fresh_gaps) < 1e-3, fresh_gaps
    stale_gaps = [gap for staleness, gap in trainer.recorded_logp_gaps if staleness > 0]
    assert stale_gaps and max(stale_gaps) > 1e-3  # lr 1e-3 moves the policy: stale rows really are off-policy


def test_on_policy_batch_and_loss_equal_trl_sync(tmp_path, dataset, tokenizer):
    """With max_staleness=0, the same rows give TRL's batch dict and TRL's loss, and the generator's behaviour
    log-probs (temperature 0.7) equal the trainer's."""
    torch.manual_seed(0)
    args = make_args(tmp_path, max_staleness=0, temperature=0.7, max_steps=1)
    ours = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    sync_args = make_args(tmp_path, config_cls=GRPOConfig, temperature=0.7, max_steps=1)
    theirs = GRPOTrainer(
        model=load_model(),
        reward_funcs=answer_reward,
        args=sync_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    inputs = next(iter(ours.get_train_dataloader()))
    ours.model.train()
    theirs.model.train()
    try:
        batch = ours._generate_and_score_completions(inputs)
        rows = batch["completion_ids"], batch["completion_mask"]
        # Give TRL's synchronous path the same completions (sampling is random; the rows must be the same).
        theirs._generate_single_turn = lambda *a, **k: (
            [ids[m.bool()].tolist() for ids, m in zip(*rows, strict=True)],
            None,
        )
        reference = theirs._generate_and_score_completions(inputs)
    finally:
        ours.close_rollout()
    assert set(reference) == TRL_BATCH_KEYS
    assert set(batch) == TRL_BATCH_KEYS | OUR_EXTRA_KEYS
    for key in TRL_BATCH_KEYS:
        assert torch.equal(batch[key], reference[key]), key
    assert (batch["rollout_versions"] == 0).all()
    for trainer in (ours, theirs):  # set by Trainer's training loop, which we do not run here
        trainer.current_gradient_accumulation_steps = 1
    loss_ours = ours._compute_loss(ours.model, batch)
    loss_theirs = theirs._compute_loss(theirs.model, reference)
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=0)
    with torch.no_grad():
        logps, _, _ = theirs._get_per_token_logps_and_entropies(
            theirs.model,
            torch.cat([reference["prompt_ids"], reference["completion_ids"]], 1),
            torch.cat([reference["prompt_mask"], reference["completion_mask"]], 1),
            reference["completion_ids"].size(1),
        )
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(batch["sampling_per_token_logps"][mask], logps[mask], atol=1e-4, rtol=0)


def test_lora_syncs_only_adapters(tmp_path, dataset, tokenizer):
    from peft import LoraConfig

    args = make_args(tmp_path, max_staleness=1, max_steps=4, learning_rate=5e-3)
    trainer = InstrumentedTrainer(
        model=load_model(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    published = []
    original = trainer._publish_weights

    def spy(version):
        if trainer._rollout is not None:
            published.append(list(trainer._rollout.trainable_store.buffers))
        original(version)

    trainer._publish_weights = spy
    trainer.train()
    assert published, "weights were never published"
    names = published[0]
    assert names and all("lora_" in name for name in names)
    base_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if n in set(names)) < base_params / 20
    fresh_gaps = [gap for staleness, gap in trainer.recorded_logp_gaps if staleness == 0]
    assert fresh_gaps and max(fresh_gaps) < 1e-3  # the generator's adapters follow the trainer's


class RaiseAtStep(TrainerCallback):
    def __init__(self, step, error):
        self.step, self.error = step, error

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error


def _generator_pid(trainer):
    return trainer._rollout.process.pid


@pytest.mark.parametrize("error", [None, KeyboardInterrupt(), RuntimeError("boom in a callback")])
def test_generator_is_stopped_on_every_exit_path(tmp_path, dataset, tokenizer, error):
    args = make_args(tmp_path, max_steps=3)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    pids = []
    trainer.add_callback(type("Spy", (TrainerCallback,), {"on_step_end": lambda s, *a, **k: pids.append(
        _generator_pid(trainer))})())  # fmt: skip
    if error is not None:
        trainer.add_callback(RaiseAtStep(2, error))
        with pytest.raises(type(error)):
            trainer.train()
    else:
        trainer.train()
    assert pids and len(set(pids)) == 1
    assert trainer._rollout is None
    assert pid_is_gone(pids[0])


def failing_reward(completions, **kwargs):
    raise ValueError("reward function exploded on purpose")


def test_generator_failure_surfaces_with_child_traceback(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, generator_heartbeat_timeout=60.0)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=failing_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    start = time.time()
    with pytest.raises(GeneratorError) as info:
        trainer.train()
    assert "reward function exploded on purpose" in str(info.value)
    assert "Traceback" in str(info.value)
    assert time.time() - start < 60
    assert trainer._rollout is None


def hanging_reward(completions, **kwargs):
    time.sleep(3600)


def test_hung_generator_is_detected_by_heartbeat(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, generator_heartbeat_timeout=4.0)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=hanging_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    start = time.time()
    with pytest.raises(GeneratorError, match="no progress"):
        trainer.train()
    assert time.time() - start < 60


def test_eval_uses_synchronous_generation(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, max_steps=1, per_device_eval_batch_size=8, eval_strategy="no")
    trainer = AsyncGRPOTrainer(
        model=load_model(),
        reward_funcs=answer_reward,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(8)),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and trainer._rollout is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"weight_sync_steps": 0}, "weight_sync_steps"),
        ({"max_staleness": 1, "weight_sync_steps": 3}, "weight_sync_steps"),
        ({"generation_backend": "sglang"}, "generation_backend"),
        ({"generation_backend": "vllm"}, "generation_backend"),
        ({"queue_capacity": 0}, "queue_capacity"),
        ({"generation_num_threads": 0}, "generation_num_threads"),
        ({"generator_heartbeat_timeout": 0}, "generator_heartbeat_timeout"),
        ({"steps_per_generation": 4, "gradient_accumulation_steps": 1, "max_staleness": 1}, "max_staleness"),
        ({"loss_type": "m2pox"}, "loss_type"),
    ],
)
def test_config_validation_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        make_args(tmp_path, **overrides)


def test_plain_grpo_config_with_bad_async_field_is_rejected(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, config_cls=GRPOConfig)
    args.max_staleness = -2
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncGRPOTrainer(model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
                         processing_class=tokenizer)  # fmt: skip


def test_unsupported_features_fail_clearly(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path)
    with pytest.raises(ValueError, match="iterable train_dataset"):
        AsyncGRPOTrainer(model=load_model(), reward_funcs=answer_reward, args=args,
                         train_dataset=dataset.to_iterable_dataset(), processing_class=tokenizer)  # fmt: skip
