# A short asynchronous GRPO run on the bundled tiny model with one fault injected, for tests/test_faults.py. Runs as
# `python faulty_run.py ...` or under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo). Each rank writes
# what the tests check into <records>/rank<k>/: info.json (its pid, its generation process's, its spool janitor's, every
# descendant process, its spool folder), saving.jsonl and saved.jsonl (each checkpoint save that began, that returned),
# fired.json (the moment a signal fault was sent, and what SIGINT did in this process when it started), train.json (the
# steps a run started and ended at) and exit.json (how it ended: the exception type and message, or none).
#
# Faults (--fault):
#   none
#   signal:<INT|TERM|KILL>@step:<k>            the trainer sends itself the signal as step k begins
#   signal:<INT|TERM|KILL>@timer:<seed>        ... after a random delay (seeded) once its generation process serves;
#                                              the last step waits for it, so that it always lands inside train()
#   signal:<INT|TERM|KILL>@saving:<where>:<n>  ... during its n-th checkpoint save, right after <where>: model (the
#                                              weights), optimizer (optimizer and scheduler), rollout_state (Trainer's
#                                              part done, trl_async's prompt-stream file next); with a ":gated" suffix,
#                                              once the generation process has filled the queue and waits at the gate
#   reward_raises@rank:<r>                     a reward function that raises in rank r's generation process
#   kill_generator@rank:<r>:step:<k>           rank r's trainer SIGKILLs its generation process as step k begins
#   kill_trainer@rank:<r>:step:<k>             rank r's trainer SIGKILLs itself as step k begins
#   file_size_limit@save:<n>                   RLIMIT_FSIZE of 64 KiB before the n-th save: writes fail (EFBIG)
#   read_only@save:<n>                         `mount -o remount,ro` the output folder before the n-th save (EROFS;
#                                              needs the folder to be a mount point this process may remount)
import argparse
import json
import os
import pathlib
import random
import resource
import signal
import subprocess
import threading
import time
import traceback

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.support.trainer_utils import load_model, load_tokenizer, make_args  # noqa: E402
from trl_async import AsyncGRPOTrainer  # noqa: E402
from trl_async.toy import make_arithmetic_dataset  # noqa: E402
from trl_async.trainers import checkpoints  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--records", required=True)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--phase", choices=("run", "resume"), default="run")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--save-total-limit", type=int, default=None)
    return parser.parse_args()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def sigint_disposition() -> str:
    """What SIGINT does in this process: "KeyboardInterrupt" (Python's default handler), "ignored" (SIG_IGN, inherited
    from a parent that ignores it: Python then installs no handler) or "blocked" in the calling thread."""
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return "blocked"
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler:
        return "KeyboardInterrupt"
    return "ignored" if handler == signal.SIG_IGN else repr(handler)


SIGINT_AT_START = sigint_disposition()  # as the run starts, before the trainer is built


class Fault:
    def __init__(self, spec: str, rank: int, output_dir: str, records: "Records"):
        self.spec, self.rank, self.output_dir, self.records = spec, rank, output_dir, records
        self.kind, _, where = spec.partition("@")
        self.where = where.split(":")
        self.signal = None
        if self.kind.startswith("signal:"):
            self.signal = getattr(signal, "SIG" + self.kind.split(":")[1])
        self.on_this_rank = not (len(self.where) >= 2 and self.where[0] == "rank" and int(self.where[1]) != rank)

    def step(self) -> int | None:
        if "step" in self.where:
            return int(self.where[self.where.index("step") + 1])
        return None

    def fire(self, moment: str) -> None:
        """Send the signal, first recording that it was sent and where (the tests check the moment they meant)."""
        self.records.write("fired.json", {"moment": moment, "sigint_at_start": SIGINT_AT_START})
        os.kill(os.getpid(), self.signal)

    def during_save(self, where: str, save_index: int, queue) -> None:
        if self.signal is not None and self.where[:1] == ["saving"] and self.where[1] == where:
            if int(self.where[2]) == save_index:
                if self.where[-1] == "gated":
                    wait_until_gated(queue)
                self.fire(f"saving:{where}:{save_index}")

    def before_save(self, save_index: int) -> None:
        if self.where[:1] != ["save"] or int(self.where[1]) != save_index:
            return
        if self.kind == "file_size_limit":
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif self.kind == "read_only":
            subprocess.run(["mount", "-o", "remount,ro", self.output_dir], check=True)


def wait_until_gated(queue, guard_s: float = 120.0) -> None:
    """Until the producer has put every item it reserved and the queue is full: it then waits at the gate, and stays
    there while the trainer consumes nothing (it is saving)."""
    counters, deadline = queue._counters, time.monotonic() + guard_s
    while time.monotonic() < deadline:
        if counters.produced == counters.reserved and counters.reserved - counters.consumed >= queue.capacity:
            return
        time.sleep(0.01)
    raise RuntimeError("the generation process never filled the queue")


class LengthReward:
    """A text reward; raises in the generation process of the rank the fault names, from its fourth call on."""

    __name__ = "length_reward"

    def __init__(self, raise_on_rank: int | None, rank: int, trainer_pid: int):
        self.raise_on_rank, self.rank, self.trainer_pid, self.calls = raise_on_rank, rank, trainer_pid, 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        if self.rank == self.raise_on_rank and os.getpid() != self.trainer_pid and self.calls >= 4:
            raise ValueError(f"this reward fails on purpose on rank {self.rank}")
        return [len(c[0]["content"]) / 50.0 for c in completions]


class Records:
    def __init__(self, root: str, rank: int):
        self.folder = os.path.join(root, f"rank{rank}")
        os.makedirs(self.folder, exist_ok=True)

    def write(self, name: str, value) -> None:
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump(value, f)

    def append(self, name: str, value) -> None:
        with open(os.path.join(self.folder, name), "a") as f:
            f.write(json.dumps(value) + "\n")


class FaultyTrainer(AsyncGRPOTrainer):
    fault: Fault
    records: Records
    saves = 0

    def _save_checkpoint(self, model, trial):
        self.saves += 1
        self.fault.before_save(self.saves)
        self.records.append("saving.jsonl", {"step": self.state.global_step})
        super()._save_checkpoint(model, trial)
        self.records.append("saved.jsonl", {"step": self.state.global_step})

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)
        if _internal_call:
            self.fault.during_save("model", self.saves, self._rollout.queue)

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        self.fault.during_save("optimizer", self.saves, self._rollout.queue)


class Injector(TrainerCallback):
    def __init__(self, trainer: FaultyTrainer):
        self.trainer, self.info, self.timer = trainer, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step
        self.trainer.records.write("train.json", {"first_step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.records.write("train.json", {"first_step": self.first_step, "last_step": state.global_step})

    def on_step_end(self, args, state, control, **kwargs):
        rollout = self.trainer._rollout
        if self.info is None and rollout.process is not None and rollout.process.ready:
            self.info = {
                "trainer_pid": os.getpid(),
                "generator_pid": rollout.process.pid,
                "janitor_pid": rollout._janitor.pid,
                "descendants": descendants(os.getpid()),
                "spool": rollout.queue.spool_dir,
            }
            self.trainer.records.write("info.json", self.info)
            fault = self.trainer.fault
            if fault.signal is not None and fault.where[0] == "timer":
                delay = random.Random(int(fault.where[1])).uniform(0.0, 3.0)
                self.timer = threading.Timer(delay, fault.fire, args=(f"timer:{delay:.3f}s",))
                self.timer.start()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.timer is not None and state.global_step + 1 == args.max_steps:
            # A fast run could otherwise end before the delay: the signal would then reach an interpreter that is
            # shutting down (Python reports the KeyboardInterrupt as ignored and exits 0), not the training run.
            self.timer.join()
        fault = self.trainer.fault
        if not fault.on_this_rank or fault.step() != state.global_step + 1 or self.info is None:
            return
        if fault.kind == "kill_generator":
            os.kill(self.info["generator_pid"], signal.SIGKILL)
        elif fault.kind == "kill_trainer":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.signal is not None:
            fault.fire(f"step:{state.global_step + 1}")


def main(options, records: Records, rank: int):
    fault = Fault(options.fault, rank, options.output_dir, records)
    raise_on = int(fault.where[1]) if fault.kind == "reward_raises" else None
    args = make_args(
        pathlib.Path(options.output_dir),
        output_dir=options.output_dir,
        max_steps=options.max_steps,
        save_strategy="steps" if options.phase == "run" else "no",
        save_steps=options.save_steps,
        save_total_limit=options.save_total_limit,
        max_staleness=1,
        trainer_generates_while_starting=False,
        generator_heartbeat_timeout=3600.0,  # a fault must be reported by what sees it, not by a silent generator
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = FaultyTrainer(
        model=load_model(),
        reward_funcs=LengthReward(raise_on, rank, os.getpid()),
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=256, num_test=8, seed=1)["train"],
        processing_class=load_tokenizer(),
    )
    trainer.fault, trainer.records = fault, records
    trainer.add_callback(Injector(trainer))
    original = checkpoints.write_rollout_state

    def write_rollout_state(states, checkpoint_dir):
        fault.during_save("rollout_state", trainer.saves, trainer._rollout.queue)
        original(states, checkpoint_dir)

    checkpoints.write_rollout_state = write_rollout_state
    trainer.train(resume_from_checkpoint=True if options.phase == "resume" else None)


if __name__ == "__main__":
    options = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    records = Records(options.records, rank)
    try:
        main(options, records, rank)
    except BaseException as error:
        records.write(
            "exit.json",
            {
                "type": type(error).__name__,
                "message": str(error),
                "code": error.code if isinstance(error, SystemExit) else None,
                "traceback": traceback.format_exc(),
            },
        )
        raise
    records.write("exit.json", {"type": None})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # see tests/scripts/two_ranks.py
