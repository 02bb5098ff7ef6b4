"""What `AsyncRolloutMixin` adds to Trainer's loop: the dataloader's placeholder ticks and the callbacks that run at
every optimizer step's end (on every rank: the points where the ranks meet for their collectives).

The callbacks hold the trainer weakly and call its methods; the order they are added in (`AsyncRolloutMixin.__init__`)
is the order they run in: the timeline's step first, then the figures' reduction, then the weights' publishing.
"""

from __future__ import annotations

import weakref

import torch
from transformers import TrainerCallback

from ..timeline import names as span


class PublishWeights(TrainerCallback):
    """Publishes the policy to the generation process after each optimizer step (every `weight_sync_steps`)."""

    def __init__(self, trainer):  # an AsyncRolloutMixin
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer._rollout_started():
            seconds = trainer._rollout.publish(trainer._unwrap(trainer.model), state.global_step, state)
            if seconds:
                trainer._metrics["train"]["async/weight_sync_s"].append(seconds)


class ReduceStatistics(TrainerCallback):
    """Reduces the trainers' figures over the ranks at the end of every optimizer step at which Trainer logs (or stops
    training): a point every rank passes, unlike `log`, which users may call on one rank (`trainers.statistics`).
    Added after transformers' `DefaultFlowCallback`, which decides `should_log` in its own `on_step_end`."""

    def __init__(self, trainer):  # an AsyncRolloutMixin
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and (control.should_log or control.should_training_stop):
            trainer._reduce_statistics("train")


class TimelineSteps(TrainerCallback):
    """The timeline's step boundaries (`trl_async.timeline`): a step opens when Trainer starts one, and its optimizer
    step is the time from the last micro-batch's forward + backward to the step's end (clipping, `optimizer.step`,
    the scheduler, `zero_grad`). First among the trainers' callbacks: weights are published after it."""

    def __init__(self, trainer):  # an AsyncRolloutMixin
        self._trainer = weakref.ref(trainer)

    def on_step_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._timeline.set_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._timeline.end(span.OPTIMIZER_STEP, trainer._timeline.last_end())


class RolloutTicks(torch.utils.data.Dataset):
    """What the training dataloader iterates in async mode: one placeholder per dataset row, so that TRL's sampler,
    lengths, epochs and resume skipping work unchanged while the rows themselves come from the rollout component."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {"prompt": index}


class EndlessRolloutTicks(torch.utils.data.IterableDataset):
    """The same for an iterable train dataset: ticks without end (TRL then needs `max_steps`, as for any iterable)."""

    def __iter__(self):
        index = 0
        while True:
            yield {"prompt": index}
            index += 1
