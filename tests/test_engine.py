"""The rollout engine inside real training runs: real generation processes, the bundled tiny model, TRL's loop.

Staleness here is measured from the weights that really generated each batch (see `WeightTracingTrainer`), never
from the engine's own tags alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tests.support.trainer_utils import (
    WeightTracingTrainer,
    answer_reward,
    length_reward,
    load_model,
    make_args,
)
from trl_async import AsyncGRPOTrainer
from trl_async.toy import make_arithmetic_dataset


def slow_length_reward(completions, **kwargs):
    import time

    time.sleep(0.6)  # runs in the generation process: makes generating a batch slower than a training step
    return length_reward(completions)


def logged_steps(trainer):
    return [h for h in trainer.state.log_history if "reward" in h]


# ----------------------------------------------------------------------------------------------- staleness bound
@pytest.mark.parametrize(
    "schedule",
    [
        # one generation batch per optimizer step (TRL's default schedule), generator ahead by one version
        dict(max_staleness=1),
        # steps_per_generation != gradient accumulation: a generation batch feeds 2 micro-steps of 2 optimizer steps
        dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=4, max_staleness=2),
        # num_iterations > 1: every batch is trained on twice
        dict(num_iterations=2, max_staleness=2, per_device_train_batch_size=8),
        # weights published every second step only
        dict(weight_sync_steps=2, max_staleness=2),
        # a generator slower than a training step: the trainer publishes new weights while a batch is being
        # generated, so the version that generated it and the newest version differ when it is queued
        dict(max_staleness=2, slow_reward=True),
        # several generation batches per decode (2 of 8 rows; the bound derived for them, 3), handed out one by one
        dict(max_rows_per_decode=16),
        # 3 per decode with a slow generator (bound 5): blocks decoded while the trainer publishes
        dict(max_rows_per_decode=24, slow_reward=True),
        # 2 per decode where each generation batch feeds 2 micro-steps of 2 optimizer steps
        dict(steps_per_generation=4, gradient_accumulation_steps=2, per_device_train_batch_size=4,
             max_rows_per_decode=32),
    ],
    ids=["default", "steps_per_generation", "num_iterations", "weight_sync_steps", "slow_generator", "blocks_of_2",
         "blocks_of_3_slow", "blocks_steps_per_generation"],
)  # fmt: skip
def test_no_row_older_than_max_staleness_reaches_a_loss(tmp_path, dataset, tokenizer, schedule):
    schedule = dict(schedule)
    reward = slow_length_reward if schedule.pop("slow_reward", False) else length_reward
    args = make_args(tmp_path, max_steps=10, loss_type="dapo", trainer_generates_while_starting=False, **schedule)
    trainer = WeightTracingTrainer(
        model=load_model(), reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.true_staleness, "no batch reached a loss"
    assert max(trainer.true_staleness) <= args.max_staleness, trainer.true_staleness
    # The engine's tags name weights that really generated the rows.
    assert all(trainer.tag_is_true), list(zip(trainer.tagged_staleness, trainer.true_staleness, strict=True))
    # The bound is exercised: the generator ran ahead, so stale rows did reach the loss.
    assert max(trainer.true_staleness) >= 1
    rows_per_decode = [h["async/rows_per_decode"] for h in trainer.state.log_history if "async/rows_per_decode" in h]
    batch_rows = args.per_device_train_batch_size * args.steps_per_generation
    expected = schedule.get("max_rows_per_decode", batch_rows)
    # Every batch came from a decode of whole batches, at most the block; the block is reached.
    assert rows_per_decode and max(rows_per_decode) == expected, rows_per_decode
    assert all(batch_rows <= r <= expected for r in rows_per_decode), rows_per_decode
    # The timeline shows each decode's rows (the generation process's decode spans).
    from trl_async import timeline

    trace = timeline.load_trace(args.output_dir)
    generator = next(p["pid"] for p in timeline.analysis.processes(trace) if p["role"] == "generator")
    decoded = [e["args"]["rows"] for e in trace["traceEvents"] if e.get("pid") == generator and e["name"] == "decode"]
    assert decoded and max(decoded) == expected, decoded
    # Nothing beyond the run's end: the generation process decoded the batches the schedule needed (one per
    # generation batch whose first use comes before max_steps), and one more for each it had evicted.
    g, a = args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps
    needed = math.ceil(args.max_steps * a / g)
    evicted_rows = sum(h.get("async/evicted", 0) for h in trainer.state.log_history)
    assert sum(decoded) == needed * batch_rows + evicted_rows, (decoded, needed, evicted_rows)


class _EpochEnd(TrainerCallback):
    def __init__(self):
        self.epochs = 0

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epochs += 1


@pytest.mark.parametrize(
    ("num_prompts", "schedule"),
    [
        # 5 generation batches of one micro-step per epoch, 2 micro-steps per optimizer step: the epoch's last
        # micro-step gets an optimizer step of its own, which the gate's schedule did not predict.
        (10, dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=1)),
        # One generation batch per epoch used over 3 micro-steps, 2 micro-steps per optimizer step: each batch is
        # trained on across two optimizer steps, and each epoch ends with an extra step. Rows must be checked at
        # their LAST use.
        (6, dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=3)),
    ],
    ids=["accumulation_remainder", "multi_step_batches"],
)
def test_forced_eviction_in_a_real_run_skips_stale_batches_and_finishes(tmp_path, tokenizer, num_prompts, schedule):
    """An epoch whose micro-steps do not fill the last accumulation window makes the Trainer step early at the
    epoch's end: the generator's schedule was off, its queued batches become too stale and are evicted. The run must
    skip them, go on, log them, and never train on a stale row."""
    small = make_arithmetic_dataset(num_train=num_prompts, num_test=2, seed=3)["train"]
    args = make_args(
        tmp_path, max_steps=9, num_generations=4, max_staleness=1, loss_type="dapo",
        trainer_generates_while_starting=False, **schedule,
    )  # fmt: skip
    trainer = WeightTracingTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=small, processing_class=tokenizer
    )
    epochs = _EpochEnd()
    trainer.add_callback(epochs)
    trainer.train()
    assert trainer.state.global_step == 9 and epochs.epochs >= 2
    evicted = sum(h.get("async/evicted", 0) for h in trainer.state.log_history)
    assert evicted > 0, "no batch was evicted: the test did not exercise eviction"
    assert max(trainer.true_staleness) <= 1, trainer.true_staleness
    fractions = [h["async/evicted_fraction"] for h in trainer.state.log_history if "async/evicted_fraction" in h]
    assert all(0 <= f < 1 for f in fractions)


# ----------------------------------------------------------------------------------------------- reproducibility
def _completions_and_losses(tmp_path, dataset, tokenizer, seed, name):
    args = make_args(tmp_path / name, max_staleness=0, max_steps=4, seed=seed, log_completions=True)
    recorded = []

    class Recording(AsyncGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                recorded.append(out["completion_ids"].clone())
            return out

    trainer = Recording(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return recorded, losses


def test_same_seed_same_run_on_policy(tmp_path, dataset, tokenizer):
    first = _completions_and_losses(tmp_path, dataset, tokenizer, seed=7, name="a")
    second = _completions_and_losses(tmp_path, dataset, tokenizer, seed=7, name="b")
    other = _completions_and_losses(tmp_path, dataset, tokenizer, seed=8, name="c")
    assert len(first[0]) == 4
    for a, b in zip(first[0], second[0], strict=True):
        assert torch.equal(a, b)
    assert first[1] == pytest.approx(second[1], rel=1e-6, abs=1e-7)
    assert any(a.shape != c.shape or not torch.equal(a, c) for a, c in zip(first[0], other[0], strict=True))


# ----------------------------------------------------------------------------------------------- start-up
class _StopAfterQueueBatches(TrainerCallback):
    def __init__(self, seen: list, queue_batches: int):
        self.seen, self.queue_batches = seen, queue_batches

    def on_step_end(self, args, state, control, **kwargs):
        if sum(not from_trainer for _, from_trainer in self.seen) >= self.queue_batches:
            control.should_training_stop = True


def _record_batches(trainer, monkeypatch) -> list[tuple[int, bool]]:
    """Every batch the trainer takes, as (its stream index, whether the trainer made it), in order."""
    seen: list[tuple[int, bool]] = []
    next_batch = trainer._rollout.next_batch

    def recording_next_batch(*args, **kwargs):
        batch = next_batch(*args, **kwargs)
        seen.append((batch.payload.stream_index, batch.from_trainer))
        return batch

    monkeypatch.setattr(trainer._rollout, "next_batch", recording_next_batch)
    return seen


def test_start_up_switch_trains_every_stream_batch_once_in_order(tmp_path, dataset, tokenizer, monkeypatch):
    """Default start-up: the trainer makes the first batches itself while the generation process starts, and the
    queue opens one batch ahead of the trainer's last one. Across the switch, every batch of the prompt stream is
    trained on exactly once and in order: the trainer's batches first, then only the process's."""
    args = make_args(tmp_path, max_steps=400)  # a cap: training stops a few queue batches after the switch
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    seen = _record_batches(trainer, monkeypatch)
    trainer.add_callback(_StopAfterQueueBatches(seen, queue_batches=4))
    trainer.train()
    indices, from_trainer = zip(*seen, strict=True)
    assert list(indices) == list(range(len(seen)))
    made_by_trainer = from_trainer.index(False)
    assert made_by_trainer >= 1 and not any(from_trainer[made_by_trainer:])
    assert len(seen) - made_by_trainer >= 4


class _TrainUntilTheQueueOpens(TrainerCallback):
    """Keeps the first training step going (as a long step at 0.5B does) until the queue opens, which only the opener
    thread can do while the trainer is not asking for a batch."""

    def __init__(self, trainer):
        self.trainer, self.opened_during_the_step = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            import time

            deadline = time.time() + 60
            while not self.trainer._rollout.queue.is_open and time.time() < deadline:
                time.sleep(0.05)
            self.opened_during_the_step = self.trainer._rollout.queue.is_open


def test_a_generator_ready_while_the_trainer_trains_takes_over_at_the_next_batch(tmp_path, dataset, tokenizer,
                                                                                 monkeypatch):  # fmt: skip
    """The queue opens as soon as the generation process is ready, also in the middle of a training step: at the next
    batch the trainer would have made itself (not one later, as while it makes one), so no stream batch is skipped or
    trained twice, and the trainer makes no batch beyond the first."""
    args = make_args(tmp_path, max_steps=6)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    seen = _record_batches(trainer, monkeypatch)
    waiting = _TrainUntilTheQueueOpens(trainer)
    trainer.add_callback(waiting)
    trainer.train()
    assert waiting.opened_during_the_step, "the queue did not open while the trainer was training"
    assert seen == [(0, True)] + [(index, False) for index in range(1, 6)], seen


def test_a_generator_ready_while_the_trainer_makes_a_batch_takes_over_one_batch_later(tmp_path, dataset, tokenizer,
                                                                                     monkeypatch):  # fmt: skip
    """The queue opens while the trainer makes its first batch itself (its own generation is slow, as at 0.5B): the
    process starts at the batch after the one the trainer is making, so the trainer's batch is not made twice, and
    the trainer makes no batch beyond it."""
    args = make_args(tmp_path, max_steps=6)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    seen = _record_batches(trainer, monkeypatch)
    opened_while_making: list[bool] = []
    pipeline = trainer._rollout
    produce_locally = pipeline._produce_locally

    def slow_produce_locally(*args, **kwargs):
        import time

        deadline = time.time() + 60  # the first batch is made until the opener thread has opened the queue
        while not opened_while_making and not pipeline.queue.is_open and time.time() < deadline:
            time.sleep(0.05)
        opened_while_making.append(pipeline.queue.is_open)
        return produce_locally(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_produce_locally", slow_produce_locally)
    trainer.train()
    assert opened_while_making == [True], "the queue did not open while the trainer made its batch"
    assert seen == [(0, True)] + [(index, False) for index in range(1, 6)], seen


# ----------------------------------------------------------------------------------------------- data sources
def test_iterable_dataset_trains_asynchronously(tmp_path, dataset, tokenizer):
    streaming = dataset.to_iterable_dataset(num_shards=2)
    args = make_args(tmp_path, max_steps=4, trainer_generates_while_starting=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=streaming, processing_class=tokenizer
    )
    trainer.train()
    logged = logged_steps(trainer)
    assert len(logged) == 4 and all("async/staleness_mean" in h for h in logged)
    assert sum(h["async/trainer_generated_batches"] for h in logged) == 0  # the generation process made them all


def test_reward_model_is_scored_in_the_trainer(tmp_path, dataset, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from trl_async.toy import tiny_model_path

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    args = make_args(tmp_path, max_steps=3, reward_weights=[1.0, 0.5], trainer_generates_while_starting=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=[reward_model, length_reward], args=args, train_dataset=dataset,
        processing_class=tokenizer, reward_processing_classes=[tokenizer, None],
    )  # fmt: skip
    name = trainer.reward_func_names[0]
    trainer.train()
    logged = logged_steps(trainer)
    assert len(logged) == 3 and all("async/staleness_mean" in h for h in logged)
    model_means = [h[f"rewards/{name}/mean"] for h in logged]
    assert all(math.isfinite(v) for v in model_means)
    assert len({round(v, 6) for v in model_means}) > 1  # real scores of real completions, not a constant


def trainer_state_reward(completions, trainer_state, log_extra, log_metric, **kwargs):
    step = trainer_state.global_step
    log_extra("generated_at_step", [step] * len(completions))
    log_metric("reward_fn/step_seen", float(step))
    return [float(step)] * len(completions)


def test_reward_callables_get_trainer_state_log_extra_and_log_metric(tmp_path, dataset, tokenizer):
    args = make_args(tmp_path, max_steps=4, log_completions=True, trainer_generates_while_starting=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=trainer_state_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    seen_extra = []
    original_log = trainer.log

    def spy(logs, start_time=None):
        seen_extra.append(list(trainer._logs["extra"].get("generated_at_step", [])))
        return original_log(logs, start_time)

    trainer.log = spy
    trainer.train()
    logged = logged_steps(trainer)
    assert len(logged) == 4
    for entry in logged:
        # The reward saw the trainer state of the weights that generated the rows: at most max_staleness old.
        step_seen = entry["reward_fn/step_seen"]
        assert entry["step"] - 1 - args.max_staleness <= step_seen <= entry["step"] - 1
        assert entry["reward"] == step_seen
    assert any(values for values in seen_extra)
    assert all(v == int(v) for values in seen_extra for v in values)


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        (dict(quantization_config=object()), "quantized"),
    ],
)
def test_unsupported_settings_are_refused_before_anything_starts(tmp_path, dataset, tokenizer, kwargs, setting):
    import multiprocessing

    kwargs = dict(kwargs)
    args = make_args(tmp_path, **kwargs.pop("args_overrides", {}))
    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(ValueError, match=setting) as info:
        AsyncGRPOTrainer(
            model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
            processing_class=tokenizer, **kwargs,
        )  # fmt: skip
    assert "async_generation=False" in str(info.value)
    assert set(p.pid for p in multiprocessing.active_children()) == before


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_installed_fails_up_front_with_the_install_command(tmp_path, dataset, tokenizer):
    import multiprocessing

    args = make_args(tmp_path, use_vllm=True)
    with pytest.raises(ImportError, match="trl-async\\[vllm\\]"):
        AsyncGRPOTrainer(
            model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
            processing_class=tokenizer,
        )  # fmt: skip
    assert args.generation_backend == "vllm" and not multiprocessing.active_children()


def test_plain_grpo_config_gets_the_staleness_its_schedule_needs(tmp_path, dataset, tokenizer):
    from trl import GRPOConfig

    args = make_args(
        tmp_path, config_cls=GRPOConfig, steps_per_generation=4, num_iterations=2, gradient_accumulation_steps=3,
        per_device_train_batch_size=4,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    # A generation batch feeds 8 micro-steps, 3 per optimizer step: batch 1 (micro-steps 8-15) is trained on at
    # versions 2..5, a span of 3; one more lets generation overlap training.
    assert trainer.args.max_staleness == 4


def test_explicit_too_small_staleness_still_errors(tmp_path):
    with pytest.raises(ValueError, match="max_staleness >= 3"):
        make_args(tmp_path, steps_per_generation=4, num_iterations=2, gradient_accumulation_steps=3, max_staleness=1)


def test_overrides_work_on_a_trainer_built_without_init():
    """TRL's unit tests build trainers with `object.__new__` and a namespace as `args`; our overrides must then fall
    through to TRL's (here `_generate` with a `rollout_func`), reading async fields with their defaults."""
    from types import SimpleNamespace

    from trl_async.config import async_field

    trainer = object.__new__(AsyncGRPOTrainer)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    trainer.use_vllm = False
    trainer.tools = None
    trainer._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    trainer.eos_token_ids = [2]
    trainer.processing_class = SimpleNamespace(batch_decode=lambda ids, **kwargs: ["decoded"] * len(ids))
    trainer._metrics = {"train": __import__("collections").defaultdict(list)}
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]}
    result = trainer._generate(["prompt"])
    assert result[0] == [[1]] and result[1] == [[2]]
    assert async_field(trainer.args, "async_generation") is True
    assert async_field(trainer.args, "max_staleness") is None


def test_dataset_of_pairs_with_custom_columns_reaches_rewards(tmp_path, tokenizer):
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "answer": str(2 * i), "tag": i} for i in
         range(32)]
    )  # fmt: skip

    def reward(completions, answer, tag, **kwargs):
        return [float(int(a) == 2 * t) for a, t in zip(answer, tag, strict=True)]

    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=reward, args=make_args(tmp_path, max_steps=2), train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    assert all(h["reward"] == 1.0 for h in logged_steps(trainer))


def test_ranks_sharing_a_group_never_sample_identical_completions(tokenizer):
    """One prompt per generation batch, its 8 generations split over 2 ranks (4 each): with per-rank seeds the two
    ranks' samples of the same prompt differ (TRL seeds ranks differently for the same reason)."""
    from trl_async.rollout import GeneratorSpec, ModelSpec, RolloutProducer, generate_with_behaviour_logprobs
    from trl_async.rollout.backends import generation_config_for_rollouts

    model = load_model().eval()
    data = make_arithmetic_dataset(num_train=16, num_test=2, seed=4)["train"]
    from transformers import GenerationConfig

    config = generation_config_for_rollouts(
        GenerationConfig(max_new_tokens=12, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=[tokenizer.eos_token_id])
    )  # fmt: skip
    batches = {}
    for rank in (0, 1):
        spec = GeneratorSpec(
            process_index=rank, num_processes=2, device="cpu", num_threads=1, backend="hf",
            model_spec=ModelSpec(config=model.config, dtype=torch.float32), generation_config=config,
            temperature=1.0, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
            processing_class=tokenizer, chat_template=None, chat_template_kwargs={}, dataset=data,
            num_generations=8, generation_batch_size=8, shuffle=True, seed=0, reward_funcs=[length_reward],
            reward_func_names=["length_reward"], decode=False, parent_pid=0,
        )  # fmt: skip
        producer = RolloutProducer(
            spec,
            lambda batches, ready=None: [
                generate_with_behaviour_logprobs(
                    model, b.prompt_ids, config, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu", seed=b.seed
                )
                for b in batches
            ],
        )
        batches[rank] = [producer.produce(i) for i in range(3)]
    for first, second in zip(batches[0], batches[1], strict=True):
        assert first.rows == second.rows  # the same prompt: one group across both ranks
        assert first.completion_ids != second.completion_ids
