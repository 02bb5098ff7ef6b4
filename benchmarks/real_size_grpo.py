"""The real-size job written as a plain TRL script: `GRPOTrainer` at TRL's defaults on the job `bench_real_size.py`
runs with the recipe's Qwen config.

    python benchmarks/real_size_grpo.py MODEL_DIR DATA_JSONL OUTPUT_DIR --max-steps 16
    python benchmarks/real_size_grpo.py MODEL_DIR DATA_JSONL OUTPUT_DIR --max-steps 16 --steps-per-generation 2

The same job as the recipe's run in `bench_real_size.py`: the model folder, LoRA r=8 (alpha 16, dropout 0.05, all
seven projections), the GSM8K-format rows (a `prompt`, `answer` JSONL the benchmark writes from the same file), 8 rows
a step (4 prompts x 2 completions, one micro-batch), completions forced to 64 tokens (`min_new_tokens`), the recipe's
learning rate, schedule, temperature, beta and seed, logging every step. What stays TRL's: the trainer, its default
loss (TRL has no M2PO), its generation schedule (`steps_per_generation` unset: one `generate` call of 8 rows per step;
`--steps-per-generation K`: one call of 8K rows every K steps), gradient checkpointing, no thread settings. The
rewards are text rewards with the recipe's semantics and weights: the final answer (`math_answer_text_reward`, the
text form of the recipe's `MathAnswerReward`) and the `####` answer marker (the recipe's `FormatReward`), 1.0 and 0.2.

Writes OUTPUT_DIR/result.json: the seconds of `trainer.train()`, each optimizer step's start (seconds after
`trainer.train()` began, from a callback: the benchmark's measurement, not part of the user's script), the end of
training, and TRL's log history.
"""

import argparse
import json
import os
import time

from datasets import load_dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_async.rewards import math_answer_text_reward  # an ordinary TRL reward function (decoded text)


def answer_marker(completions, **kwargs):
    """1.0 when the completion writes the `####` answer marker (the recipe's FormatReward(required=("#### ",)))."""
    return [float("####" in completion[0]["content"]) for completion in completions]


class StepClock(TrainerCallback):
    """The benchmark's measurement: when each optimizer step starts (Trainer's `on_step_begin`)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.step_starts = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_starts.append(time.perf_counter() - self.started)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("data_file", metavar="DATA_JSONL", help="rows with `prompt` (conversational) and `answer`")
    parser.add_argument("output_dir", metavar="OUTPUT_DIR")
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--steps-per-generation", type=int, default=None, help="TRL's own (default: TRL's, 1)")
    parser.add_argument("--completion-length", type=int, default=64, help="forced completion length (tokens)")
    args = parser.parse_args()

    dataset = load_dataset("json", data_files=args.data_file, split="train")
    training_args = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length},
        max_steps=args.max_steps,
        learning_rate=5e-5,
        lr_scheduler_type="cosine",
        temperature=1.0,
        beta=0.0,
        reward_weights=[1.0, 0.2],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # CPU
        seed=0,
        **({"steps_per_generation": args.steps_per_generation} if args.steps_per_generation else {}),
    )
    peft_config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(
        model=args.model_dir,
        reward_funcs=[math_answer_text_reward, answer_marker],
        args=training_args,
        train_dataset=dataset,
        peft_config=peft_config,
    )
    clock = StepClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    clock.started = start
    trainer.train()
    train_s = time.perf_counter() - start
    with open(os.path.join(args.output_dir, "result.json"), "w") as f:
        json.dump({"trainer": type(trainer).__name__, "train_s": train_s, "step_starts": clock.step_starts,
                   "train_end": train_s, "steps_per_generation": training_args.steps_per_generation,
                   "generation_batch_size": training_args.generation_batch_size,
                   "log_history": trainer.state.log_history}, f)  # fmt: skip


if __name__ == "__main__":
    main()
