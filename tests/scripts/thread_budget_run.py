# Three asynchronous steps on the bundled tiny model, for tests/test_cores.py: records the torch thread count the
# trainer computes its loss with and the one the generation process scores rewards with (and that process's pid), into
# the JSON file named by the first argument. Run it with the thread budget under test (e.g. OMP_NUM_THREADS=3).
import json
import os
import pathlib
import sys

import torch  # noqa: E402

from tests.support.trainer_utils import load_model, load_tokenizer, make_args  # noqa: E402
from trl_async import AsyncGRPOTrainer  # noqa: E402
from trl_async.toy import make_arithmetic_dataset  # noqa: E402


class ThreadsSeen:
    """A text reward that appends (pid, torch threads) of the process it runs in to a file."""

    __name__ = "threads_seen"

    def __init__(self, path: str):
        self.path = path

    def __call__(self, completions, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps([os.getpid(), torch.get_num_threads()]) + "\n")
        return [0.0] * len(completions)


class RecordingTrainer(AsyncGRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.trainer_threads.append(torch.get_num_threads())
        return super()._compute_loss(model, inputs)


def main(out: str):
    seen = out + ".rewards"
    trainer = RecordingTrainer(
        model=load_model(),
        reward_funcs=ThreadsSeen(seen),
        args=make_args(
            pathlib.Path(out).parent,
            max_steps=3,
            lend_idle_cores=False,  # the split itself, not the lending on top of it
            trainer_generates_while_starting=False,  # every batch from the generation process
        ),
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=2, seed=0)["train"],
        processing_class=load_tokenizer(),
    )
    trainer.trainer_threads = []
    trainer.train()
    with open(seen) as f:
        rewards = [json.loads(line) for line in f]
    with open(out, "w") as f:
        json.dump({"trainer_pid": os.getpid(), "trainer_threads": trainer.trainer_threads, "rewards": rewards}, f)


if __name__ == "__main__":
    main(sys.argv[1])
