# A GRPO script written the way TRL's documentation writes one: a prompt dataset, a text reward function, a
# GRPOConfig and a model given by path. `test_dropin.py` runs it with only the trainer's class name swapped.
# Deliberately no `if __name__ == "__main__":` guard, as in TRL's quickstart.
import json
import os
import sys

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

model_path, data_file, output_dir = sys.argv[1:4]
max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
dataset = load_dataset("json", data_files=data_file, split="train")


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


training_args = GRPOConfig(
    output_dir=output_dir,
    max_steps=max_steps,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=16,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    bf16=False,
)
trainer = GRPOTrainer(model=model_path, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()

if trainer.accelerator.is_main_process:  # one writer under `accelerate launch`
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump({"trainer": type(trainer).__name__, "log_history": trainer.state.log_history}, f)
