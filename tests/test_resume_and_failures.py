"""Resuming asynchronous runs from checkpoints, and a generation process killed at random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
import torch
from transformers import TrainerCallback

from tests.support.trainer_utils import (
    WeightTracingTrainer,
    length_reward,
    load_model,
    make_args,
    pid_is_gone,
)
from trl_async import AsyncGRPOTrainer
from trl_async.rollout import GeneratorError


class RecordingTrainer(AsyncGRPOTrainer):
    """Records every generation batch trained on: the optimizer step that used it, its completions, and the policy
    version that generated it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int, torch.Tensor, int]] = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            step = self.state.global_step + 1
            self.batches.append((step, out["completion_ids"].clone(), int(out["rollout_versions"].min())))
        return out


class _StopAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h}


def _stream_state(checkpoint) -> dict:
    """The saved stream position and version (the run's settings saved beside them are checked on resume, elsewhere)."""
    ranks = json.loads((checkpoint / "trl_async_rollout.json").read_text())["ranks"]
    assert len(ranks) == 1
    return {key: ranks[0][key] for key in ("stream_position", "version")}


def test_resume_twice_in_a_row_continues_exactly_on_policy(tmp_path, dataset, tokenizer):
    """Train 3 steps, resume to step 6, resume again to step 9: at max_staleness=0 the chain equals 9 straight steps
    (same completions in the same order, same losses, same final weights). Each checkpoint's saved stream position is
    the number of generation batches consumed up to it, as the schedule gives it: 4 micro-steps per optimizer step
    and 2 per generation batch make 2 batches per step."""
    common = dict(max_staleness=0, max_steps=9, save_strategy="steps", save_steps=3, seed=3,
                  per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=4,
                  steps_per_generation=2)  # fmt: skip
    batches_per_step = common["gradient_accumulation_steps"] // common["steps_per_generation"]  # num_iterations 1

    def trainer(name, stop_at=None):
        run = RecordingTrainer(
            model=load_model(), reward_funcs=length_reward, args=make_args(tmp_path / name, **common),
            train_dataset=dataset, processing_class=tokenizer,
        )  # fmt: skip
        if stop_at is not None:
            run.add_callback(_StopAtStep(stop_at))
        return run

    straight = trainer("straight")
    straight.train()
    # The chain: the straight run's first 3 steps (its checkpoint-3), resumed to step 6, resumed again to step 9.
    second = trainer("second", stop_at=6)
    second.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-3"))
    third = trainer("third")
    third.train(resume_from_checkpoint=str(tmp_path / "second" / "out" / "checkpoint-6"))

    assert [len(run.batches) for run in (straight, second, third)] == [9 * batches_per_step] + [
        3 * batches_per_step
    ] * 2
    chain = straight.batches[: 3 * batches_per_step] + second.batches + third.batches
    assert [step for step, _, _ in chain] == [step for step, _, _ in straight.batches]
    for (step, ids, version), (_, expected_ids, expected_version) in zip(chain, straight.batches, strict=True):
        assert torch.equal(ids, expected_ids), step
        assert version == expected_version == step - 1, step
    losses_straight = _losses(straight)
    losses_chain = {**{s: v for s, v in losses_straight.items() if s <= 3}, **_losses(second), **_losses(third)}
    assert sorted(losses_chain) == sorted(losses_straight) == list(range(1, 10))
    for step in range(1, 10):
        assert losses_chain[step] == pytest.approx(losses_straight[step], rel=1e-5, abs=1e-6), step
    final, expected_final = third.model.state_dict(), straight.model.state_dict()
    assert final.keys() == expected_final.keys()
    for name, tensor in expected_final.items():
        torch.testing.assert_close(final[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    # The saved stream positions, read back: every generation batch consumed before the checkpoint, in every run.
    for checkpoint, step in [(tmp_path / "straight" / "out" / "checkpoint-3", 3),
                             (tmp_path / "second" / "out" / "checkpoint-6", 6),
                             (tmp_path / "third" / "out" / "checkpoint-9", 9)]:  # fmt: skip
        assert _stream_state(checkpoint) == {"stream_position": step * batches_per_step, "version": step}, checkpoint
    assert sum(h.get("async/evicted", 0) for run in (straight, second, third) for h in run.state.log_history) == 0


def test_resume_with_staleness_continues_step_count_and_version(tmp_path, dataset, tokenizer):
    common = dict(max_staleness=2, max_steps=6, save_strategy="steps", save_steps=3, loss_type="dapo")
    first = RecordingTrainer(
        model=load_model(), reward_funcs=length_reward, args=make_args(tmp_path / "first", **common),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    first.train()
    resumed = WeightTracingTrainer(
        model=load_model(), reward_funcs=length_reward,
        args=make_args(tmp_path / "resumed", trainer_generates_while_starting=False, **common),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "out" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    assert resumed.loss_versions[0] == 3  # the step count continues
    # Versions continue too: no batch of the resumed run was generated before the checkpoint's weights (v3).
    assert min(resumed.loss_versions[i] - s for i, s in enumerate(resumed.true_staleness)) >= 3
    assert max(resumed.true_staleness) <= 2 and all(resumed.tag_is_true)


# ----------------------------------------------------------------------------------------------- SIGKILL
class _Killer(TrainerCallback):
    """Kills the generation process at a chosen moment: `moment` is one of
    * "generating": after a random delay once the generator serves, likely mid-batch;
    * "gated": while it waits at the gate (max_staleness=0 and a slow trainer step keep it there);
    * "publishing": right before the trainer publishes weights (from the step-end callbacks);
    * "inflight_update": the same with in-flight weight updates and long completions, so the generator is decoding
      and loads the weights just published between two decoding steps when the signal lands."""

    def __init__(self, trainer, moment, rng):
        self.trainer, self.moment, self.rng = trainer, moment, rng
        self.killed_at = None
        self.spool_dir = None
        self.pid = None

    def kill(self):
        if self.killed_at is None and self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        rollout = self.trainer._rollout
        if rollout.process is None or not rollout.process.ready or self.pid is not None:
            return
        self.pid, self.spool_dir = rollout.process.pid, rollout.queue.spool_dir
        if self.moment == "generating":
            threading.Timer(self.rng.uniform(0.0, 0.3), self.kill).start()
        elif self.moment == "gated":
            time.sleep(0.5)  # the generator has produced what the gate allows and waits for new weights
            self.kill()

    def on_step_end(self, args, state, control, **kwargs):
        if self.moment in ("publishing", "inflight_update") and self.pid is not None:
            self.kill()  # callbacks run in order: ours was added after the publishing one, so this is the moment it
            # returned; the next publish (and the next queue read) must notice


def _run_and_kill(tmp_path, dataset, tokenizer, moment, seed):
    inflight = (
        dict(inflight_weight_updates=True, max_completion_length=64, generation_kwargs={"min_new_tokens": 64})
        if moment == "inflight_update"
        else {}
    )
    args = make_args(
        tmp_path, max_steps=40, max_staleness=0 if moment == "gated" else 1, trainer_generates_while_starting=False,
        generator_heartbeat_timeout=60.0, **inflight,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    killer = _Killer(trainer, moment, random.Random(seed))
    trainer.add_callback(killer)
    with pytest.raises(GeneratorError, match="exited|failed"):
        trainer.train()
    assert killer.killed_at is not None, "the generator was never killed"
    assert time.time() - killer.killed_at < 30
    assert pid_is_gone(killer.pid)
    assert not os.path.exists(killer.spool_dir)
    assert trainer._rollout.process is None


@pytest.mark.parametrize("moment", ["generating", "gated", "publishing", "inflight_update"])
def test_killed_generator_is_reported_and_nothing_is_left(tmp_path, dataset, tokenizer, moment):
    _run_and_kill(tmp_path, dataset, tokenizer, moment, seed=0)


# The first eight of the twenty-one kills in CI's slow suite, the others nightly (benchmarks/nightly.sh), for CI's hour;
# the default suite kills once at each moment.
@pytest.mark.slow
@pytest.mark.parametrize(
    "runs",
    [pytest.param(range(0, 8), id="first_eight"), pytest.param(range(8, 21), id="rest", marks=pytest.mark.nightly)],
)
def test_killed_generator_twenty_times_at_random_moments(tmp_path, dataset, tokenizer, runs):
    rng = random.Random(1234)
    moments = [rng.choice(["generating", "gated", "publishing"]) for _ in range(21)]  # one seeded sequence
    # This process's entries only (spools are named by their trainer's pid): tests running beside it (`pytest -n 2`)
    # have theirs.
    ours = (f"trl_async-{os.getpid()}-", f"torch_{os.getpid()}_")
    before = {e for e in os.listdir("/dev/shm") if e.startswith(ours)}
    for run in runs:
        _run_and_kill(tmp_path / str(run), dataset, tokenizer, moments[run], seed=run)
    after = {e for e in os.listdir("/dev/shm") if e.startswith(ours)}
    assert after <= before
