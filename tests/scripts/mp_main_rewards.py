# A user's training script whose trainer runs in a worker process: `python mp_main_rewards.py <output_dir> <launcher>`
# calls `train` through `torch.multiprocessing.spawn` (launcher "spawn") or accelerate's `notebook_launcher`
# (launcher "notebook:<num_processes>:<port>"). A spawned worker imports this file as `__mp_main__`, not `__main__`,
# so the reward below, its helper and its constant live in a module of that name; a forked one (notebook_launcher on
# CPU) keeps `__main__`. The generation process never imports this file under either name, so the reward must reach
# it by value.
#
# The reward appends "<pid>" to <output_dir>/calls-<rank>.txt when called and returns SCALE times the completion's
# length (through the helper); each worker writes its pid, its module's name, its generation process's pid, its spool
# folder and the log history to <output_dir>/result-<rank>.json. `tests/test_main_module_rewards.py` runs it.
import json
import os
import sys

import torch.multiprocessing
from datasets import Dataset
from transformers import TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.toy import tiny_model_path

SCALE = 0.625  # read by the reward through `scaled`: a module global that must travel with it


def scaled(length: int) -> float:
    return SCALE * length


def calls_file(output_dir: str) -> str:
    return os.path.join(output_dir, f"calls-{os.environ.get('RANK', '0')}.txt")


def mp_main_length_reward(completions, completion_ids, calls_path, **kwargs):
    with open(calls_path[0], "a") as f:
        f.write(f"{os.getpid()}\n")
    return [scaled(len(ids)) for ids in completion_ids]


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


def train(*args):
    output_dir = args[-1]  # torch.multiprocessing.spawn passes the worker's index first
    # The calls file travels as a dataset column: it is per rank, and the reward reads nothing of the worker's state.
    dataset = Dataset.from_dict(
        {"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 4, "calls_path": [calls_file(output_dir)] * 16}
    )
    config = AsyncGRPOConfig(
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
        reward_funcs=[mp_main_length_reward],
        args=config,
        train_dataset=dataset,
        callbacks=[pids],
    )
    pids.trainer = trainer
    trainer.train()
    with open(os.path.join(output_dir, f"result-{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(
            {
                "worker_pid": os.getpid(),
                "script_pid": int(os.environ["MP_MAIN_REWARDS_SCRIPT_PID"]),
                "reward_module": mp_main_length_reward.__module__,
                "generator_pids": sorted(pids.pids),
                "spool_dirs": sorted(pids.spool_dirs),
                "log_history": trainer.state.log_history,
            },
            f,
        )


if __name__ == "__main__":
    output_dir, launcher = sys.argv[1], sys.argv[2]
    os.environ["MP_MAIN_REWARDS_SCRIPT_PID"] = str(os.getpid())  # inherited by the workers
    if launcher == "spawn":
        torch.multiprocessing.spawn(train, args=(output_dir,), nprocs=1)
    elif launcher.startswith("notebook:"):  # notebook:<num_processes>:<port>
        from accelerate import notebook_launcher

        _, num_processes, port = launcher.split(":")
        notebook_launcher(train, args=(output_dir,), num_processes=int(num_processes), use_port=port)
    else:
        raise SystemExit(f"unknown launcher {launcher!r}")
