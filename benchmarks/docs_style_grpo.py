# A GRPO script written the way TRL's documentation writes one: a prompt dataset, a text reward function, a plain
# GRPOConfig (TRL's defaults except the batch and step counts, and bf16=False for a CPU), a model given by path, no thread settings.
# `benchmarks/bench_docs_style.py` runs it with TRL's GRPOTrainer and, with only the class name swapped, with
# AsyncGRPOTrainer; `limit` is AsyncGRPOTrainer with `async_generation=False` (TRL's synchronous loop, with the
# timeline recorded: where the limit of overlapping generation and training comes from).
# Usage: python docs_style_grpo.py {trl,async,limit} MODEL_PATH DATA_JSONL OUTPUT_DIR [MAX_STEPS] [HELD_OUT_JSONL]
#        [SEED]   (GRPOConfig's `seed`, TRL's default 42 when not given; `bench_docs_style.py --seeds` gives one a pair)
import json
import os
import sys
import time

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from trl_async import AsyncGRPOTrainer

USAGE = (
    "usage: python docs_style_grpo.py {trl,async,limit} MODEL_PATH DATA_JSONL OUTPUT_DIR [MAX_STEPS] [HELD_OUT_JSONL] "
    "[SEED]"
)
if len(sys.argv) not in (5, 6, 7, 8) or sys.argv[1] not in (
    "trl",
    "async",
    "limit",
):  # --help or a wrong call: the usage line
    asked = sys.argv[1:] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    raise SystemExit(0 if asked else 2)
trainer_name, model_path, data_file, output_dir = sys.argv[1:5]
max_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 120
held_out_file = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] else None
seed = int(sys.argv[7]) if len(sys.argv) > 7 else 42  # TRL's default seed
dataset = load_dataset("json", data_files=data_file, split="train")


def correct_answer(completions, answer, **kwargs):
    return [
        float(c[0]["content"].rsplit("####", 1)[-1].strip() == a) for c, a in zip(completions, answer, strict=True)
    ]


training_args = GRPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=32,
    max_steps=max_steps,
    report_to="none",
    bf16=False,  # CPU
    seed=seed,
)
if trainer_name == "limit":
    training_args.async_generation = False  # AsyncGRPOTrainer's synchronous path: TRL's loop, recorded
trainer_class = GRPOTrainer if trainer_name == "trl" else AsyncGRPOTrainer
trainer = trainer_class(model=model_path, reward_funcs=correct_answer, args=training_args, train_dataset=dataset)
start = time.perf_counter()
trainer.train()
train_s = time.perf_counter() - start

held_out_accuracy = None
if held_out_file:  # the benchmark's measurement, not part of the user's script: greedy accuracy after training
    from trl_async.toy import greedy_accuracy

    held_out = load_dataset("json", data_files=held_out_file, split="train")
    held_out_accuracy = greedy_accuracy(trainer.model, trainer.processing_class, held_out)
with open(os.path.join(output_dir, "result.json"), "w") as f:
    json.dump({"trainer": type(trainer).__name__, "train_s": train_s, "held_out_accuracy": held_out_accuracy,
               "seed": training_args.seed, "log_history": trainer.state.log_history}, f)  # fmt: skip
