"""Resuming asynchronous runs from checkpoints, and a generation process killed at random moments."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
from trainer_utils import WeightTracingTrainer, length_reward, load_model, load_tokenizer, make_args, pid_is_gone
from transformers import TrainerCallback

from trl_async import AsyncGRPOTrainer
from trl_async.rollout import GeneratorError
from trl_async.toy import make_arithmetic_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=256, num_test=8, seed=1)["train"]


class RecordingTrainer(AsyncGRPOTrainer):
    """Records, per optimizer step, the completions trained on and the policy version that generated them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions_by_step: dict[int, torch.Tensor] = {}
        self.versions_by_step: dict[int, int] = {}

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            step = self.state.global_step + 1
            self.completions_by_step[step] = out["completion_ids"].clone()
            self.versions_by_step[step] = int(out["rollout_versions"].min())
        return out


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h}


def test_resume_continues_exactly_on_policy(tmp_path, dataset, tokenizer):
    """5 steps, then a resumed 5, equal 10 straight steps at max_staleness=0: same completions, same losses."""
    common = dict(max_staleness=0, max_steps=10, save_strategy="steps", save_steps=5, seed=3)
    straight = RecordingTrainer(
        model=load_model(), reward_funcs=length_reward, args=make_args(tmp_path / "straight", **common),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    straight.train()
    checkpoint = tmp_path / "straight" / "out" / "checkpoint-5"
    assert (checkpoint / "trl_async_rollout.json").exists()

    resumed = RecordingTrainer(
        model=load_model(), reward_funcs=length_reward, args=make_args(tmp_path / "resumed", **common),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert sorted(resumed.completions_by_step) == list(range(6, 11))
    for step in range(6, 11):
        assert torch.equal(resumed.completions_by_step[step], straight.completions_by_step[step]), step
        assert resumed.versions_by_step[step] == straight.versions_by_step[step] == step - 1
    losses_straight, losses_resumed = _losses(straight), _losses(resumed)
    for step in range(6, 11):
        assert losses_resumed[step] == pytest.approx(losses_straight[step], rel=1e-5, abs=1e-6), step


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
    * "publishing": right before the trainer publishes weights (from the step-end callbacks)."""

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
        if self.moment == "publishing" and self.pid is not None:
            self.kill()  # callbacks run in order: ours was added after the publishing one, so this is the moment it
            # returned; the next publish (and the next queue read) must notice


def _run_and_kill(tmp_path, dataset, tokenizer, moment, seed):
    args = make_args(
        tmp_path, max_steps=40, max_staleness=0 if moment == "gated" else 1, trainer_generates_while_starting=False,
        generator_heartbeat_timeout=60.0,
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


@pytest.mark.parametrize("moment", ["generating", "gated", "publishing"])
def test_killed_generator_is_reported_and_nothing_is_left(tmp_path, dataset, tokenizer, moment):
    _run_and_kill(tmp_path, dataset, tokenizer, moment, seed=0)


@pytest.mark.slow
def test_killed_generator_twenty_times_at_random_moments(tmp_path, dataset, tokenizer):
    rng = random.Random(1234)
    before = {e for e in os.listdir("/dev/shm") if e.startswith(("trl_async-", f"torch_{os.getpid()}_"))}
    for run in range(21):
        moment = rng.choice(["generating", "gated", "publishing"])
        _run_and_kill(tmp_path / str(run), dataset, tokenizer, moment, seed=run)
    after = {e for e in os.listdir("/dev/shm") if e.startswith(("trl_async-", f"torch_{os.getpid()}_"))}
    assert after <= before
