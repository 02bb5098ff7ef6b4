"""Math RL with trl_async: GRPO (or M2PO) from a prompt dataset and a verifiable reward.

    accelerate launch recipes/qwen_math.py                                   # bundled tiny model, offline, CPU
    python recipes/qwen_math.py                                              # same, one process
    accelerate launch recipes/qwen_math.py --config recipes/configs/qwen2.5-0.5b-gsm8k.yaml

Any field of `RecipeArguments`, `AsyncGRPOConfig` or TRL's `ModelConfig` can be set in the YAML file or on the
command line (`--learning_rate 1e-4`). Unknown YAML keys are an error that names them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

RECIPE_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(RECIPE_DIR, "configs", "tiny.yaml")
BUNDLED_MODEL = "bundled:tiny_qwen2"


@dataclass
class RecipeArguments:
    dataset: str = field(
        default="arithmetic",
        metadata={
            "help": "'arithmetic' (generated two-digit problems), a Hub dataset id in GSM8K format (e.g. "
            "'openai/gsm8k'), or a local .json/.jsonl file or folder of GSM8K-format rows (question, answer)."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a GSM8K-format dataset."})
    num_train_prompts: int = field(
        default=2000, metadata={"help": "Number of generated arithmetic training problems ('arithmetic' only)."}
    )
    reward: str = field(
        default="text",
        metadata={
            "help": "'text': decode completions and check the final answer with a regex (TRL's usual way). "
            "'tensor': the tensor-native MathAnswerReward, which scores token ids without decoding."
        },
    )
    trainer: str = field(
        default="async",
        metadata={"help": "'async': trl_async.AsyncGRPOTrainer. 'trl': TRL's own GRPOTrainer, for comparison."},
    )


def resolve_model_path(name_or_path: str) -> str:
    """The bundled model's folder, a local folder that must exist, or a Hub id (checked when loading)."""
    if name_or_path == BUNDLED_MODEL:
        from trl_async.assets import tiny_model_path

        return tiny_model_path()
    # A Hub id is "name" or "org/name"; anything else that looks like a path is treated as one.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local or os.path.exists(name_or_path):
        path = os.path.expanduser(name_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"Model path {name_or_path!r} does not exist (or is not a folder).")
        return path
    return name_or_path


def load_model_and_tokenizer(name_or_path: str, model_args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
        model = AutoModelForCausalLM.from_pretrained(path, revision=model_args.model_revision, dtype=dtype)
    except OSError as error:
        raise OSError(
            f"Could not load the model {name_or_path!r}. If it is a Hugging Face Hub id, the Hub must be reachable "
            "(or the model already in the local cache); this machine may be offline. Original error: "
            f"{str(error).splitlines()[0]}"
        ) from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_train_dataset(recipe, seed: int):
    from trl_async.data import load_gsm8k, make_arithmetic_dataset

    if recipe.dataset == "arithmetic":
        return make_arithmetic_dataset(num_train=recipe.num_train_prompts, seed=seed)["train"]
    return load_gsm8k(recipe.dataset, split=recipe.dataset_split)


def make_reward(recipe, tokenizer):
    from trl_async.rewards import MathAnswerReward, math_answer_text_reward

    if recipe.reward == "text":
        return math_answer_text_reward
    if recipe.reward == "tensor":
        return MathAnswerReward(tokenizer)
    raise ValueError(f"reward={recipe.reward!r} is unknown; use 'text' or 'tensor'.")


def reward_summary(log_history: list[dict]) -> dict:
    """Mean logged `reward` of the first and last quarter of logged training steps."""
    rewards = [entry["reward"] for entry in log_history if "reward" in entry]
    if len(rewards) < 4:
        return {"steps": len(rewards), "first_quarter": None, "last_quarter": None, "gain": None}
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    return {"steps": len(rewards), "first_quarter": first, "last_quarter": last, "gain": last - first}


def main(argv: list[str] | None = None):
    import torch
    from trl import GRPOTrainer, ModelConfig, TrlParser, get_peft_config

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer

    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Several processes without GPUs: accelerate's multi-process mode on CPU (gloo) needs its CPU flag.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    argv = sys.argv[1:] if argv is None else argv
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT_CONFIG, *argv]
    if not torch.cuda.is_available() and not any(a.startswith("--bf16") for a in argv):
        argv = [*argv, "--bf16", "false"]  # configs written for GPUs ask for bf16, which CPUs here cannot do
    parser = TrlParser((RecipeArguments, AsyncGRPOConfig, ModelConfig))
    recipe, training_args, model_args = parser.parse_args_and_config(args=argv)
    if recipe.trainer not in ("async", "trl"):
        raise ValueError(f"trainer={recipe.trainer!r} is unknown; use 'async' or 'trl'.")

    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, model_args)
    train_dataset = load_train_dataset(recipe, seed=training_args.seed)
    trainer_cls = AsyncGRPOTrainer if recipe.trainer == "async" else GRPOTrainer
    trainer = trainer_cls(
        model=model,
        reward_funcs=[make_reward(recipe, tokenizer)],
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start

    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.state.save_to_json(os.path.join(training_args.output_dir, "trainer_state.json"))
        summary = reward_summary(trainer.state.log_history)
        summary.update(seconds=round(elapsed, 1), trainer=trainer_cls.__name__)
        with open(os.path.join(training_args.output_dir, "reward_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if summary["gain"] is None:
            print(f"[qwen_math] {summary['steps']} logged steps: too few to compare quarters ({elapsed:.0f}s)")
        else:
            print(
                f"[qwen_math] mean reward: first quarter {summary['first_quarter']:.3f} -> last quarter "
                f"{summary['last_quarter']:.3f} (gain {summary['gain']:+.3f}) over {summary['steps']} logged "
                f"steps in {elapsed:.0f}s with {trainer_cls.__name__}; model saved to {training_args.output_dir}"
            )
    return trainer


if __name__ == "__main__":
    main()
