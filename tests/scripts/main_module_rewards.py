# A user's training script with reward functions of every kind defined at its top level, in `__main__`: text and
# tensor functions, decorated ones (`@tensor_reward`, `@tensor_reward(name=...)`), a `TensorReward` subclass, a
# callable class, a lambda reading a global, a closure, a `functools.partial` and an async function. The generation
# process does not run this file (see `_spawn_without_main_module` in trl_async/rollout/generator.py), so every one
# of them must travel to it by value. Deliberately no `if __name__ == "__main__":` guard, as in TRL's quickstart.
#
# Each reward appends "<name> <pid>" to <output_dir>/calls-<rank>.txt when called; the script writes the trainer's pid, the
# generation process's pid, its spool folder and the log history to <output_dir>/result-<rank>.json. `tests/test_main_module_rewards.py` runs it.
import functools
import json
import os
import sys

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rewards import TensorReward, tensor_reward
from trl_async.toy import tiny_model_path

output_dir = sys.argv[1]
CALLS = os.path.join(output_dir, f"calls-{os.environ.get('RANK', '0')}.txt")
CONSTANT = 0.25


def record(name):
    with open(CALLS, "a") as f:
        f.write(f"{name} {os.getpid()}\n")


@tensor_reward
def tensor_length(completion_ids, completion_mask, **columns):
    record("tensor_length")
    return completion_mask.sum(1).float()


@tensor_reward(name="named_tensor_length")
def twice_the_length(completion_ids, completion_mask, **columns):
    record("named_tensor_length")
    return 2.0 * completion_mask.sum(1).float()


def text_length(completions, completion_ids, **kwargs):
    record("text_length")
    return [float(len(ids)) for ids in completion_ids]


class ColumnReward(TensorReward):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def score(self, completion_ids, completion_mask, target, **columns):
        record(self.__name__)
        return torch.tensor(target, dtype=torch.float32, device=completion_ids.device) * self.scale


class CallableReward:
    def __init__(self, value):
        self.value = value

    def __call__(self, completions, **kwargs):
        record("CallableReward")
        return [self.value] * len(completions)


constant_reward = lambda completions, **kwargs: record("<lambda>") or [CONSTANT] * len(completions)  # noqa: E731


def make_offset_reward(offset):
    def offset_reward(completions, **kwargs):
        record("offset_reward")
        return [offset] * len(completions)

    return offset_reward


def scaled_reward(completions, factor, **kwargs):
    record("scaled_reward")
    return [factor] * len(completions)


async def async_reward(completions, **kwargs):
    record("async_reward")
    return [1.25] * len(completions)


class GeneratorPids(TrainerCallback):
    """The pid of this rank's generation process and its spool folder in /dev/shm, read at every step."""

    def __init__(self):
        self.trainer, self.pids, self.spool_dirs = None, set(), set()

    def on_step_end(self, args, state, control, **kwargs):
        rollout = self.trainer._rollout
        if rollout.process is not None and rollout.process.pid is not None:
            self.pids.add(rollout.process.pid)
        if rollout.queue is not None:
            self.spool_dirs.add(rollout.queue.spool_dir)


dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 4, "target": [1.5] * 16})
args = AsyncGRPOConfig(
    output_dir=output_dir,
    max_steps=3,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    bf16=False,
    use_cpu=True,
    trainer_generates_while_starting=False,  # every batch comes from the generation process
)
pids = GeneratorPids()
trainer = AsyncGRPOTrainer(
    model=tiny_model_path(),
    reward_funcs=[
        tensor_length,
        twice_the_length,
        text_length,
        ColumnReward(scale=2.0),
        CallableReward(0.75),
        constant_reward,
        make_offset_reward(0.5),
        functools.partial(scaled_reward, factor=3.0),
        async_reward,
    ],
    args=args,
    train_dataset=dataset,
    callbacks=[pids],
)
pids.trainer = trainer
trainer.train()

with open(os.path.join(output_dir, f"result-{trainer.accelerator.process_index}.json"), "w") as f:
    json.dump(
        {
            "trainer_pid": os.getpid(),
            "generator_pids": sorted(pids.pids),
            "spool_dirs": sorted(pids.spool_dirs),
            "log_history": trainer.state.log_history,
        },
        f,
    )
