# Run under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo), with TRL_ASYNC_CHECK_COLLECTIVES=1.
# Two ranks whose batches differ by design: a dict `environment_factory` routes rank 0's rows (the first half of every
# generation batch) to an environment with the `multiply` tool and rank 1's to one without tools, so rank 0's batches
# make tool calls and rank 1's never do. Each rank records what it saw into <output_dir>/rank<k>.json for
# tests/test_agentic.py to check.
import json
import os
import sys

import torch

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rewards import math_answer_text_reward
from trl_async.toy.tools import make_multiplication_dataset, tiny_tools_model_path


def main():
    output_dir = sys.argv[1]
    log = os.path.join(output_dir, "environment.txt")

    class Calculator:
        def reset(self, **kwargs):
            with open(log, "a") as f:
                f.write(f"reset Calculator {os.getpid()}\n")

        def multiply(self, a: int, b: int) -> int:
            """
            Multiply two integers.

            Args:
                a: The first factor.
                b: The second factor.

            Returns:
                The product of a and b.
            """
            with open(log, "a") as f:
                f.write(f"call multiply {os.getpid()}\n")
            return a * b

    class Silent:
        def reset(self, **kwargs):
            with open(log, "a") as f:
                f.write(f"reset Silent {os.getpid()}\n")

    # 2 ranks x 8 rows = 4 prompts x 4 generations per generation batch, in dataset order: prompts 0-1 go to rank 0,
    # 2-3 to rank 1.
    data = make_multiplication_dataset(num_train=64, num_test=0, seed=7)["train"]
    data = data.add_column("environment", ["calculator" if i % 4 < 2 else "silent" for i in range(len(data))])
    args = AsyncGRPOConfig(
        output_dir=output_dir, max_steps=4, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=48, max_tool_calling_iterations=1, learning_rate=1e-4, logging_steps=1,
        report_to="none", save_strategy="no", bf16=False, use_cpu=not torch.cuda.is_available(),
        shuffle_dataset=False, seed=0,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=args,
        train_dataset=data,
        environment_factory={"calculator": Calculator, "silent": Silent},
    )
    generators = set()

    class Pids(__import__("transformers").TrainerCallback):
        def on_step_end(self, *a, **k):
            if trainer._rollout.process is not None:
                generators.add(trainer._rollout.process.pid)

    trainer.add_callback(Pids())
    trainer.train()
    history = trainer.state.log_history
    record = {
        "process_index": trainer.accelerator.process_index,
        "steps": trainer.state.global_step,
        "trainer_pid": os.getpid(),
        "generator_pids": sorted(generators),
        "call_frequency": [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h],
        "param_checksum": sum(p.detach().double().abs().sum().item() for p in trainer.model.parameters()),
    }
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # no live gloo group at exit (pytorch/pytorch#179291)
