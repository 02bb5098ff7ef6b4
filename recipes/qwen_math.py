"""Math RL with trl_async: GRPO (or M2PO, or PPO) from a prompt dataset and a verifiable reward, evaluated before and
after.

    accelerate launch recipes/qwen_math.py                                   # bundled tiny model, offline, CPU
    accelerate launch recipes/qwen_math.py --config recipes/configs/tiny_ppo.yaml   # PPO with a learned critic
    python recipes/qwen_math.py --config recipes/configs/tiny_tools.yaml     # a calculator tool (docs/agentic.md)
    python recipes/qwen_math.py                                              # same, one process
    accelerate launch recipes/qwen_math.py --config recipes/configs/qwen2.5-0.5b-gsm8k.yaml
    ... --push_to_hub true --hub_model_id you/name                           # then push model/adapter + card

What a run leaves in `output_dir`: the model (or LoRA adapter) and tokenizer, `eval.json` (greedy accuracy on
held-out problems before and after training, with sample size and 95% intervals), `reward_summary.json`,
`trainer_state.json`, `reward_accuracy.png` and `timeline.png` (need matplotlib), `timeline.json` (where the time went:
`python -m trl_async.timeline OUTPUT_DIR`) and the model card `README.md`.

Any field of `RecipeArguments`, `AsyncGRPOConfig` (`AsyncPPOConfig` with `trainer: ppo`) or TRL's `ModelConfig` can be set in the YAML file or on the
command line (`--learning_rate 1e-4`). Unknown YAML keys are an error that names them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

RECIPE_DIR = os.path.dirname(os.path.abspath(__file__))
if RECIPE_DIR not in sys.path:
    sys.path.insert(0, RECIPE_DIR)
DEFAULT_CONFIG = os.path.join(RECIPE_DIR, "configs", "tiny.yaml")
BUNDLED_MODEL = "bundled:tiny_qwen2"
BUNDLED_TOOLS_MODEL = "bundled:tiny_qwen2_tools"  # the tool-calling variant (trl_async.toy.tools)
MULTIPLICATION = "multiplication"
REWARDS = ("tensor", "text")
GENERATED = ("arithmetic", "multiplication")  # the generated tasks (trl_async.toy), with their held-out splits
TRAINERS = ("async", "trl", "ppo")


@dataclass
class RecipeArguments:
    dataset: str = field(
        default="arithmetic",
        metadata={
            "help": "'arithmetic' (generated two-digit problems), 'multiplication' (generated three-digit products, "
            "the tools model's task: trl_async.toy.tools), a Hub dataset id in GSM8K format (e.g. 'openai/gsm8k'), or "
            "a local .json/.jsonl file or folder of GSM8K-format rows (question, answer)."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a GSM8K-format Hub dataset to train on."})
    num_train_prompts: int = field(
        default=2000,
        metadata={"help": "Number of generated training problems ('arithmetic' and 'multiplication' only)."},
    )
    num_test_prompts: int = field(
        default=500,
        metadata={
            "help": "Number of generated held-out problems ('arithmetic' and 'multiplication' only); never among the "
            "training problems."
        },
    )
    reward: str = field(
        default="tensor",
        metadata={
            "help": "'tensor': the tensor-native MathAnswerReward, which scores token ids without decoding. 'text': "
            "decode completions and check the final answer with a regex (TRL's usual way), for comparison."
        },
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Functions the model may call, as 'module:function' (e.g. trl_async.toy.tools:multiply; TRL builds "
            "each schema from its type hints and docstring), passed as `tools=`: they run in the generation process "
            "(docs/agentic.md), and in the held-out evaluation too. Needs reward: text (a tensor reward would see "
            "the tool's tokens among the completion ids)."
        },
    )
    format_reward: bool = field(
        default=False,
        metadata={
            "help": "Add the tensor-native FormatReward: 1.0 when the completion writes the '#### ' answer marker "
            "before it ends. Weight it against the answer reward with reward_weights (e.g. [1.0, 0.2])."
        },
    )
    trainer: str = field(
        default="async",
        metadata={
            "help": "'async': AsyncGRPOTrainer as configured. 'trl': the synchronous baseline of the same config "
            "(the same class with async_generation=False: TRL's own generation and training loop; loss_type='m2po' "
            "keeps working). --async_generation false does the same. 'ppo': AsyncPPOTrainer, PPO with a learned "
            "critic and GAE; the config is then an AsyncPPOConfig (vf_coef, cliprange, gamma, lam, kl_coef, ...)."
        },
    )
    eval_accuracy: bool = field(
        default=True,
        metadata={"help": "Measure greedy accuracy on held-out problems before and after training (eval.json)."},
    )
    eval_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Held-out problems: 'arithmetic', a Hub dataset id or a local .json/.jsonl file or folder in GSM8K "
            "format (question, answer). Default: the arithmetic test split, or eval_split of the Hub dataset trained "
            "on."
        },
    )
    eval_split: str = field(default="test", metadata={"help": "Split of eval_dataset to evaluate on."})
    eval_max_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many problems (default: the whole split)."}
    )
    eval_generation_batch_size: int = field(
        default=64, metadata={"help": "Prompts per `generate` call in the accuracy evaluation."}
    )
    eval_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch CPU threads of the evaluation. Default: 1 for models under 50M parameters on CPU (faster: "
            "their matrices are too small to split), else unchanged."
        },
    )
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Greedy completion length in the evaluation. Default: max_completion_length."}
    )
    plot: bool = field(
        default=True,
        metadata={
            "help": "Write reward_accuracy.png to output_dir (needs matplotlib: pip install 'trl-async[plots]')."
        },
    )

    def __post_init__(self):
        if self.reward not in REWARDS:
            raise ValueError(f"reward={self.reward!r} is unknown; use one of {list(REWARDS)}.")
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer={self.trainer!r} is unknown; use one of {list(TRAINERS)}.")
        if self.tools and self.reward != "text":
            raise ValueError(
                f"reward={self.reward!r} with tools: the tensor reward reads the completion ids, which then include "
                "the tool's tokens (a copied tool response would score). Use reward: text, which reads the model's "
                "own turns."
            )
        if self.tools and self.trainer == "ppo":
            raise ValueError(
                "tools with trainer: ppo: AsyncPPOTrainer does not support tools yet; use trainer: async."
            )
        for name in ("num_train_prompts", "num_test_prompts", "eval_generation_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("eval_max_samples", "eval_max_new_tokens", "eval_num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None (default) or >= 1, got {value}.")


def resolve_model_path(name_or_path: str) -> str:
    """The bundled model's folder, a local folder that must exist, or a Hub id (checked when loading)."""
    if name_or_path == BUNDLED_MODEL:
        from trl_async.toy import tiny_model_path

        return tiny_model_path()
    if name_or_path == BUNDLED_TOOLS_MODEL:
        from trl_async.toy import tiny_tools_model_path

        return tiny_tools_model_path()
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
    from accuracy import load_math_dataset

    from trl_async.toy import make_arithmetic_dataset

    if recipe.dataset == "arithmetic":
        splits = make_arithmetic_dataset(
            num_train=recipe.num_train_prompts, num_test=recipe.num_test_prompts, seed=seed
        )
        return splits["train"]
    if recipe.dataset == MULTIPLICATION:
        from trl_async.toy import make_multiplication_dataset

        return make_multiplication_dataset(recipe.num_train_prompts, recipe.num_test_prompts, seed=seed)["train"]
    return load_math_dataset(recipe.dataset, recipe.dataset_split, "dataset", "dataset_split")


def load_tools(names: list[str]) -> list:
    """The callables named 'module:function' (the module imported, the function read from it)."""
    import importlib

    tools = []
    for name in names:
        module_name, _, function_name = name.partition(":")
        if not module_name or not function_name:
            raise ValueError(f"tools: {name!r} is not 'module:function' (e.g. trl_async.toy.tools:multiply).")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"tools: {name!r} cannot be loaded: {error}") from error
        if not callable(function):
            raise ValueError(f"tools: {name!r} is {type(function).__name__}, not a function.")
        tools.append(function)
    return tools


def make_rewards(recipe, tokenizer) -> list:
    """The reward functions: the final answer (tensor or text), plus the format reward when asked for."""
    from trl_async.rewards import FormatReward, MathAnswerReward, math_answer_text_reward

    if recipe.reward not in REWARDS:
        raise ValueError(f"reward={recipe.reward!r} is unknown; use one of {list(REWARDS)}.")
    rewards = [MathAnswerReward(tokenizer) if recipe.reward == "tensor" else math_answer_text_reward]
    if recipe.format_reward:
        rewards.append(FormatReward(tokenizer, required=("#### ",)))
    return rewards


def dataset_hub_id(name: str | None) -> str | None:
    from trl_async.data import looks_like_local_path

    return name if name not in (None, *GENERATED) and not looks_like_local_path(name) else None


def _option(argv: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in argv (the last one wins, as in argparse), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def requested_trainer(argv: list[str]) -> str:
    """`trainer` from the command line, else from the YAML config: it picks the config class before parsing, since
    PPO's fields (vf_coef, ...) are unknown to AsyncGRPOConfig and would be refused as unknown keys."""
    trainer = _option(argv, "trainer")
    if trainer is None:
        import yaml

        with open(_option(argv, "config") or DEFAULT_CONFIG) as f:
            trainer = (yaml.safe_load(f) or {}).get("trainer", RecipeArguments.trainer)
    return trainer


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help`: TrlParser's "(default: ...)" after each option, and the module docstring's command lines as written."""


CONFIG_HELP = """\
--config FILE   a YAML file of any of the options above, without the dashes (default: recipes/configs/tiny.yaml;
                `trainer: ppo` in it selects AsyncPPOConfig's options). The command line overrides the file."""


def parse_args(argv: list[str]):
    import torch
    from trl import ModelConfig, TrlParser

    from trl_async import AsyncGRPOConfig, AsyncPPOConfig

    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT_CONFIG, *argv]
    if not torch.cuda.is_available() and not any(a.startswith("--bf16") for a in argv):
        argv = [*argv, "--bf16", "false"]  # configs written for GPUs ask for bf16, which CPUs here cannot do
    config_class = AsyncPPOConfig if requested_trainer(argv) == "ppo" else AsyncGRPOConfig
    # TrlParser reads --config itself, before argparse: the epilog is where --help can show it.
    parser = TrlParser(
        (RecipeArguments, config_class, ModelConfig),
        description=__doc__,
        epilog=CONFIG_HELP,
        formatter_class=HelpFormatter,
    )
    recipe, training_args, model_args = parser.parse_args_and_config(args=argv)
    if recipe.trainer == "trl":
        # The A/B baseline: the same config through TRL's synchronous generation. Switching off only relaxes what
        # AsyncGRPOConfig validated.
        training_args.async_generation = False
    return recipe, training_args, model_args


def run_accuracy(recipe, state, model, tokenizer, dataset, training_args, tools=()) -> dict:
    """Greedy accuracy on `dataset`, split across all processes (every process must call it); with `tools`, the
    model's tool calls are executed as in training (the completion length is then the whole multi-turn
    completion's)."""
    from accuracy import evaluate_sharded

    start = time.perf_counter()
    result = evaluate_sharded(
        state, model, tokenizer, dataset,
        max_new_tokens=recipe.eval_max_new_tokens or training_args.max_completion_length,
        batch_size=recipe.eval_generation_batch_size, num_threads=recipe.eval_num_threads,
        tools=list(tools), max_tool_calling_iterations=training_args.max_tool_calling_iterations,
    )  # fmt: skip
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def accuracy_results(recipe, training_args, eval_name: str, before: dict, after: dict) -> dict:
    """The content of eval.json: both accuracies, the gain and the standard error of the paired differences."""
    for result in (before, after):  # the per-problem flags stay out of eval.json; their rate is kept
        result.pop("tool_calls", None)
    paired = [int(a) - int(b) for a, b in zip(after.pop("hits"), before.pop("hits"), strict=True)]
    mean = sum(paired) / len(paired)
    variance = sum((d - mean) ** 2 for d in paired) / max(len(paired) - 1, 1)
    tools = {"tools": list(recipe.tools)} if recipe.tools else {}
    return {
        **tools,
        "dataset": eval_name,
        "split": recipe.eval_split if eval_name in GENERATED or dataset_hub_id(eval_name) else None,
        "num_samples": len(paired),
        "decoding": "greedy",
        "max_new_tokens": recipe.eval_max_new_tokens or training_args.max_completion_length,
        "train_dataset": {"name": recipe.dataset, "hub_id": dataset_hub_id(recipe.dataset)},
        "before": before,
        "after": after,
        "gain": after["accuracy"] - before["accuracy"],
        "gain_standard_error": (variance / len(paired)) ** 0.5,
    }


def save_timeline_gantt(output_dir: str) -> str | None:
    """`timeline.png` beside the reward plot: the Gantt chart of ten steps of the run's timeline (`trl_async.timeline`),
    or None without a timeline (a synchronous run, `timeline=False`) or without matplotlib."""
    from trl_async import timeline

    if not os.path.exists(os.path.join(output_dir, timeline.TIMELINE_FILE)):
        return None
    path = os.path.join(output_dir, "timeline.png")
    try:
        timeline.draw_gantt(output_dir, path)
    except ImportError:
        return None
    return path


def main(argv: list[str] | None = None):
    import torch
    from accelerate import PartialState
    from trl import get_peft_config

    from trl_async import AsyncGRPOTrainer, AsyncPPOTrainer
    from trl_async.hub import (
        PLOT_FILE,
        read_eval_results,
        reward_summary,
        validate_push_args,
        write_eval_results,
    )

    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Several processes without GPUs: accelerate's multi-process mode on CPU (gloo) needs its CPU flag.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    recipe, training_args, model_args = parse_args(sys.argv[1:] if argv is None else argv)
    validate_push_args(training_args)

    # Everything that can fail on bad input fails here, before the model loads.
    train_dataset = load_train_dataset(recipe, seed=training_args.seed)
    eval_dataset = eval_name = None
    if recipe.eval_accuracy:
        from accuracy import load_eval_dataset

        eval_dataset, eval_name = load_eval_dataset(recipe, seed=training_args.seed)
    tools = load_tools(recipe.tools)
    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, model_args)
    # The process state the trainer will use: transformers sets it up (CPU-aware for multi-process CPU runs) when
    # the args' device is first read, and PartialState is a singleton that then returns it.
    _ = training_args.device
    state = PartialState()

    before = None
    if eval_dataset is not None:
        model.to(state.device)
        before = run_accuracy(recipe, state, model, tokenizer, eval_dataset, training_args, tools)
        if state.is_main_process:
            print(f"[qwen_math] greedy accuracy before training: {before['accuracy']:.3f} ({before['correct']}/"
                  f"{before['total']} held-out problems of {eval_name}, {before['seconds']:.0f}s)", flush=True)  # fmt: skip

    trainer_class = AsyncPPOTrainer if recipe.trainer == "ppo" else AsyncGRPOTrainer
    trainer = trainer_class(
        model=model,
        reward_funcs=make_rewards(recipe, tokenizer),
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        **({"tools": tools} if tools else {}),
    )
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start

    output_dir = training_args.output_dir
    label = trainer_class.__name__ + ("" if training_args.async_generation else " (synchronous generation)")
    main_process = trainer.accelerator.is_main_process
    after = None
    if eval_dataset is not None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        after = run_accuracy(recipe, state, model, tokenizer, eval_dataset, training_args, tools)
    if main_process and after is not None:
        os.makedirs(output_dir, exist_ok=True)
        results = accuracy_results(recipe, training_args, eval_name, before, after)
        write_eval_results(output_dir, results)
        print(f"[qwen_math] greedy accuracy on {results['num_samples']} held-out problems of {eval_name}: before "
              f"{before['accuracy']:.3f} ({before['correct']}/{before['total']}) -> after {after['accuracy']:.3f} "
              f"({after['correct']}/{after['total']}), {results['gain']:+.3f} (paired s.e. "
              f"{results['gain_standard_error']:.3f}); written to {os.path.join(output_dir, 'eval.json')}", flush=True)  # fmt: skip
        # The trackers (report_to) get them too, as eval/accuracy_*.
        trainer.log({"eval_accuracy_before": before["accuracy"], "eval_accuracy_after": after["accuracy"],
                     "eval_accuracy_gain": results["gain"], "eval_accuracy_samples": float(results["num_samples"])})  # fmt: skip
    if main_process:
        os.makedirs(output_dir, exist_ok=True)
        summary = reward_summary(trainer.state.log_history)
        summary.update(seconds=round(elapsed, 1), trainer=label)
        eval_results = read_eval_results(output_dir) if eval_dataset is not None else None
        if eval_results is not None:
            summary.update(
                accuracy_before=eval_results["before"]["accuracy"], accuracy_after=eval_results["after"]["accuracy"]
            )
        with open(os.path.join(output_dir, "reward_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        trainer.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        if recipe.plot:
            from curves import plot_run

            title = f"{model_args.model_name_or_path} on {recipe.dataset}, {label}"
            path = plot_run(trainer.state.log_history, eval_results, os.path.join(output_dir, PLOT_FILE), title)
            print(f"[qwen_math] picture: {path}" if path else "[qwen_math] no picture: pip install 'trl-async[plots]' "
                  "(matplotlib) to get reward_accuracy.png", flush=True)  # fmt: skip
            timeline_png = save_timeline_gantt(output_dir)
            if timeline_png:
                print(f"[qwen_math] where the time went: {timeline_png} (python -m trl_async.timeline {output_dir})")
        if summary["gain"] is None:
            print(f"[qwen_math] {summary['steps']} logged steps: too few to compare quarters ({elapsed:.0f}s)")
        else:
            print(
                f"[qwen_math] mean reward: first quarter {summary['first_quarter']:.3f} -> last quarter "
                f"{summary['last_quarter']:.3f} (gain {summary['gain']:+.3f}) over {summary['steps']} logged "
                f"steps in {elapsed:.0f}s with {label}; model saved to {output_dir}",
                flush=True,
            )
    trainer.accelerator.wait_for_everyone()

    dataset_name = dataset_hub_id(recipe.dataset)
    if training_args.push_to_hub:
        # Saves the model, writes the card (trl_async.hub), uploads output_dir: every rank must call it.
        commit = trainer.push_to_hub(commit_message="trl_async: end of training", dataset_name=dataset_name)
        if trainer.accelerator.is_main_process:
            print(f"[qwen_math] pushed to {trainer.hub_model_id}: {getattr(commit, 'commit_url', commit)}", flush=True)
    else:
        trainer.save_model(output_dir)
        trainer.create_model_card(dataset_name=dataset_name)
    return trainer


if __name__ == "__main__":
    from accelerate import PartialState

    main()
    # An undestroyed gloo/NCCL process group can abort the interpreter's exit (SIGABRT, "terminate called without an
    # active exception": its worker threads outlive Python; pytorch/pytorch#179291). Every rank first passes its last
    # collective, so that no rank tears down a connection its peer still uses. Both are no-ops in a single process.
    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()
