"""AsyncGRPOTrainer end to end on the bundled tiny model: real generator processes, real forward passes."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tests.support.trainer_utils import WeightTracingTrainer, load_model, make_args
from trl_async import AsyncGRPOTrainer
from trl_async.rollout import GeneratorError

# The keys of TRL 1.16's batch dict for text-only GRPO; see `test_batch_dict_contract_matches_trl`.
TRL_BATCH_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}
OUR_EXTRA_KEYS = {"sampling_per_token_logps", "rollout_versions", "rollout_token_versions"}


def answer_reward(completions, answer, **kwargs):
    """A text reward as TRL's docs write them: 1.0 when the text after '####' is the answer."""
    return [
        float(c[0]["content"].rsplit("####", 1)[-1].strip() == a) for c, a in zip(completions, answer, strict=True)
    ]


def length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 50.0 for c in completions]


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(pid, 0); it is gone for our purposes only once reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def test_plain_grpo_config_runs_async_with_defaults(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, config_cls=GRPOConfig)
    trainer = WeightTracingTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    assert trainer.args.async_generation and trainer.args.max_staleness == 1
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 3
    for key in ("async/staleness_mean", "async/evicted", "async/queue_size", "async/generator_wait_s",
                "async/trainer_wait_s", "async/staleness_max", "completions/mean_length"):  # fmt: skip
        assert key in logged[-1], key
    # The default bound, measured from the weights whose log-probs reproduce each batch's μ (not the engine's tags).
    assert len(trainer.true_staleness) == 3 and max(trainer.true_staleness) <= 1 and all(trainer.tag_is_true)
    assert logged[-1]["async/evicted"] == 0


def test_on_policy_batch_and_loss_equal_trl_sync(tmp_path, dataset, tokenizer):
    """With max_staleness=0 and greedy decoding, TRL's own generation and ours produce the same rows: the batch dict
    and the loss are exactly TRL's. The generation process's first batch is the first batch of TRL's sampler."""
    greedy = dict(max_staleness=0, max_steps=1, generation_kwargs={"do_sample": False})
    ours = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=make_args(tmp_path, **greedy), train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    sync_args = make_args(tmp_path, config_cls=GRPOConfig, max_steps=1, generation_kwargs={"do_sample": False})
    theirs = GRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=sync_args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    ours.model.train()
    theirs.model.train()
    try:
        batch = ours._generate_and_score_completions(next(iter(ours.get_train_dataloader())))
        reference = theirs._generate_and_score_completions(next(iter(theirs.get_train_dataloader())))
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


def test_lora_syncs_only_adapters(tmp_path, dataset, tokenizer):
    from peft import LoraConfig

    args = make_args(
        tmp_path, max_staleness=1, max_steps=4, learning_rate=5e-3, trainer_generates_while_starting=False
    )
    trainer = WeightTracingTrainer(
        model=load_model(),
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    published = []
    original = trainer._rollout.publish

    def spy(model, version, state=None):
        published.append(list(trainer._rollout.trainable_store.buffers))
        return original(model, version, state)

    trainer._rollout.publish = spy
    trainer.train()
    assert published, "weights were never published"
    names = published[0]
    assert names and all("lora_" in name for name in names)
    base_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if n in set(names)) < base_params / 20
    # The generator's adapters follow the trainer's: every batch's μ is reproduced by the version it is tagged with.
    assert trainer.tag_is_true and all(trainer.tag_is_true)
    assert max(trainer.true_staleness) >= 1


def test_peft_model_with_reference_adapter_and_kl(tmp_path, dataset, tokenizer):
    """A PEFT model passed in with beta > 0: TRL adds a frozen `ref` adapter for the KL term; it stays on the
    trainer (the generator samples from the policy adapter only)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = make_args(tmp_path, max_steps=3, beta=0.1, trainer_generates_while_starting=False)
    trainer = WeightTracingTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    assert "ref" in trainer.model.peft_config
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kl" in h]
    assert len(logged) == 3 and all(math.isfinite(h["kl"]) for h in logged)
    assert all(trainer.tag_is_true)


class RaiseAtStep(TrainerCallback):
    def __init__(self, step, error):
        self.step, self.error = step, error

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error


def _generator_handle(trainer):
    return trainer._rollout.process


@pytest.mark.parametrize("error", [None, KeyboardInterrupt(), RuntimeError("boom in a callback")])
def test_generator_is_stopped_on_every_exit_path(tmp_path, dataset, tokenizer, error):
    args = make_args(tmp_path, max_steps=3)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    handles = []
    trainer.add_callback(type("Spy", (TrainerCallback,), {"on_step_end": lambda s, *a, **k: handles.append(
        _generator_handle(trainer))})())  # fmt: skip
    if error is not None:
        trainer.add_callback(RaiseAtStep(2, error))
        with pytest.raises(type(error)):
            trainer.train()
    else:
        trainer.train()
    handles = [h for h in handles if h is not None]
    assert handles and len(set(map(id, handles))) == 1
    assert trainer._rollout.process is None
    assert handles[0].pid is not None  # launched (`close` waits for a launch in progress), then stopped
    assert pid_is_gone(handles[0].pid)


def failing_reward(completions, **kwargs):
    raise ValueError("reward function exploded on purpose")


def test_generator_failure_surfaces_with_child_traceback(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, generator_heartbeat_timeout=60.0, trainer_generates_while_starting=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=failing_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    start = time.time()
    with pytest.raises(GeneratorError) as info:
        trainer.train()
    assert "reward function exploded on purpose" in str(info.value)
    assert "Traceback" in str(info.value)
    assert time.time() - start < 60
    assert trainer._rollout.process is None


def test_reward_failure_in_a_batch_the_trainer_generates_raises_it_directly(tmp_path, dataset, tokenizer):
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=failing_reward, args=make_args(tmp_path), train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    with pytest.raises(ValueError, match="reward function exploded on purpose"):
        trainer.train()
    assert trainer._rollout.process is None


def hanging_reward(completions, **kwargs):
    time.sleep(3600)


def test_hung_generator_is_detected_by_heartbeat(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, generator_heartbeat_timeout=4.0, trainer_generates_while_starting=False)
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
    assert "eval_reward" in metrics and not trainer._rollout.started


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"weight_sync_steps": 0}, "weight_sync_steps"),
        ({"max_staleness": 1, "weight_sync_steps": 3}, "weight_sync_steps"),
        ({"generation_backend": "sglang"}, "generation_backend"),
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
