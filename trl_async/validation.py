"""Checks of the user's inputs, run when the trainer is built: before any model is downloaded where they can be, and
always before the generation process starts.

Every error names the setting, column, file or id at fault and says what to do. Inputs that can only be judged once
they exist (a reward's output, a batch's prompts drawn from a dataset too large to scan up front) are checked where
they appear, with the same messages: the reward runner checks every reward output (`rewards/runner.py`), and the
generation process checks the prompts of every batch it draws (`check_prompt_ids`). `docs/errors.md` lists each case
with its message; `tests/test_bad_inputs.py` runs each one.

What TRL, transformers or torch already refuse with a clear message (a batch size that `num_generations` does not
divide, `num_generations=1`, no reward function, a missing checkpoint folder, a negative learning rate) is left to
them.

This module is imported by the generation process: it imports neither TRL nor transformers at module level.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Rows of a map-style dataset checked (and, for their length, tokenized) when the trainer is built. A larger dataset
# has its first rows checked there, and every batch's prompts when the generation process draws them.
UPFRONT_ROWS = 20_000

# Keyword arguments TRL passes to every reward function besides the dataset columns (`GRPOTrainer._calculate_rewards`).
TRL_REWARD_KWARGS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)
# Dataset columns TRL does not pass to reward functions (it passes them as `prompts`, `completions`, ...).
NOT_REWARD_COLUMNS = frozenset({"prompt", "completion", "completion_ids"})
# What `Trainer` keeps of a dataset when `remove_unused_columns=True` (`GRPOTrainer._set_signature_columns_if_needed`).
TRL_SIGNATURE_COLUMNS = ("prompt", "image", "images")
# Checkpoint file of the prompt stream's position (written by `AsyncGRPOTrainer._save_checkpoint`).
ROLLOUT_CHECKPOINT_FILE = "trl_async_rollout.json"
# Settings that decide which rows the prompt stream hands out: a checkpoint's stream position means nothing under others.
RUN_GEOMETRY = ("num_processes", "generation_batch_size", "num_generations", "seed", "shuffle_dataset", "dataset_rows")
# Model config entries that fix the shapes of the weights: a checkpoint written for other values cannot be loaded.
WEIGHT_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


# ------------------------------------------------------------------------------------------------------- settings
def check_generation_device(device: str | None) -> None:
    """`generation_device` names a device type torch knows, and that device exists on this machine."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"generation_device={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N' (or leave it unset for the "
            f"device accelerate gives this rank). torch says: {str(error).splitlines()[0]}"
        ) from None
    if parsed.type == "cpu":
        return
    if parsed.type == "meta":
        raise ValueError("generation_device='meta' holds no data and cannot generate: use 'cpu' or 'cuda:N'.")
    module = getattr(torch, parsed.type, None)
    available = bool(module is not None and hasattr(module, "is_available") and module.is_available())
    if parsed.type == "mps":
        available = torch.backends.mps.is_available()
    if not available:
        raise ValueError(
            f"generation_device={device!r}: this machine has no {parsed.type} device (torch.{parsed.type}."
            "is_available() is False). Use 'cpu', or leave generation_device unset for the device accelerate gives "
            "this rank."
        )
    count = module.device_count() if hasattr(module, "device_count") else 1
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"generation_device={device!r}: this machine has {count} {parsed.type} device(s), "
            f"{parsed.type}:0 to {parsed.type}:{count - 1}. Use one of them, or leave generation_device unset."
        )


def check_sampling_settings(args) -> None:
    """TRL's sampling settings, which transformers checks only when it first generates (then in the generation
    process), or under another name (`max_new_tokens`): refused here, with what to set instead."""
    temperature = getattr(args, "temperature", 1.0)
    if temperature is None or not temperature > 0:
        raise ValueError(
            f"temperature={temperature!r}: GRPO samples completions and needs temperature > 0 (TRL's default is 1.0; "
            "lower values, e.g. 0.7, sample closer to greedy)."
        )
    max_completion_length = getattr(args, "max_completion_length", None)
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(
            f"max_completion_length={max_completion_length!r} must be an integer >= 1 (the most tokens a completion "
            "may have; TRL's default is 256)."
        )
    top_p = getattr(args, "top_p", 1.0)
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1.0 keeps every token; TRL's default).")
    top_k = getattr(args, "top_k", None)
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 or None: no top-k filtering).")
    min_p = getattr(args, "min_p", None)
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p!r} must be in [0, 1], or None (no min-p filtering).")
    repetition_penalty = getattr(args, "repetition_penalty", 1.0)
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty={repetition_penalty!r} must be > 0 (1.0: no penalty).")


def check_vllm_installed(args) -> None:
    """`generation_backend='vllm'` (or TRL's `use_vllm=True`) in colocate mode needs vLLM importable here."""
    import importlib.util

    wants_vllm = getattr(args, "generation_backend", "hf") == "vllm" or getattr(args, "use_vllm", False)
    if wants_vllm and getattr(args, "vllm_mode", "colocate") != "server" and importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "generation_backend='vllm' (or use_vllm=True) needs vLLM in this environment: `pip install "
            "trl-async[vllm]` on GPUs; on CPUs follow docs/vllm.md (`bash .ci/vllm_env.sh`). Or set "
            "generation_backend='hf'."
        )


# ------------------------------------------------------------------------------------------------------- models
def check_model_id(model: Any, args=None, setting: str = "model") -> None:
    """A model given as a string is a local folder, or a Hub id whose config can be fetched (or is cached). The error
    names the id: transformers' own says only that the Hub could not be reached."""
    if not isinstance(model, str):
        return
    if os.path.isdir(model):
        return  # a local folder: transformers reports what is missing in it
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
    if looks_like_path:
        raise OSError(
            f"{setting}={model!r} is not an existing folder (nor a Hub id, which has the form 'org/name'). Check the "
            "path, or pass a Hub id."
        )
    from transformers import AutoConfig

    kwargs = dict(getattr(args, "model_init_kwargs", None) or {}) if setting == "model" else {}
    trust_remote_code = kwargs.get("trust_remote_code", getattr(args, "trust_remote_code", False))
    try:
        AutoConfig.from_pretrained(model, revision=kwargs.get("revision"), trust_remote_code=bool(trust_remote_code))
    except OSError as error:  # not found, not reachable, gated: transformers' other errors are clear as they are
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        reason = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
            if offline
            else "it is not a local folder, and its config could not be fetched from the Hub"
        )
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(
            f"{setting}={model!r} cannot be loaded: {reason}. Download it where the Hub is reachable (`hf download "
            f"{model}`) or pass the path of a local copy. ({type(error).__name__}: {first})"
        ) from error


def check_eos_and_pad(tokenizer: Any) -> None:
    """Completions end at an EOS token and are padded with the pad token: a tokenizer without them cannot be used.
    (TRL uses the EOS token as pad token when the tokenizer has none, before this check runs.)"""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has no eos_token, so completions could never end: set "
            "`tokenizer.eos_token` to the token that ends a completion (e.g. '<|im_end|>' or '</s>') and pass it as "
            "processing_class."
        )
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has no pad_token: set `tokenizer.pad_token` (e.g. to its "
            "eos_token) and pass it as processing_class."
        )


def context_length(config: Any) -> int | None:
    """The model's context window in tokens, from its (text) config; None if the config does not say."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# ------------------------------------------------------------------------------------------------------- rewards
def _reward_name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _missing_arguments(fn: Any, provided: set[str], skip_positional: int = 0) -> list[str]:
    """Parameters of `fn` without a default that a call with keyword arguments `provided` would leave unfilled."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to learn
        return []
    missing, skipped = [], 0
    for parameter in signature.parameters.values():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if skipped < skip_positional and parameter.kind != inspect.Parameter.KEYWORD_ONLY:
            skipped += 1  # passed positionally (a tensor reward's completion_ids, completion_mask)
            continue
        if parameter.default is inspect.Parameter.empty and parameter.name not in provided:
            missing.append(parameter.name)
    return missing


def check_reward_funcs(reward_funcs: Any, args=None, dataset_columns: Sequence[str] | None = None) -> None:
    """Each entry of `reward_funcs` is a callable, a model or a model id; each function's required arguments and
    required dataset columns are among what TRL passes it (when the dataset's columns are known)."""
    from .rewards.base import TensorReward, _FunctionTensorReward, is_tensor_reward

    funcs = reward_funcs if isinstance(reward_funcs, list) else [] if reward_funcs is None else [reward_funcs]
    for index, fn in enumerate(funcs):
        if isinstance(fn, str):
            check_model_id(fn, args, setting=f"reward_funcs[{index}]")
            continue
        if isinstance(fn, torch.nn.Module) and not is_tensor_reward(fn):
            continue  # a reward model: TRL scores it
        if not callable(fn):
            raise TypeError(
                f"reward_funcs[{index}] is {fn!r} ({type(fn).__name__}): a reward must be a function (or callable "
                "object) returning one float per completion, a TensorReward, a reward model, or a reward model's id."
            )
    if dataset_columns is None:
        return
    columns = set(dataset_columns)
    if args is not None and getattr(args, "remove_unused_columns", False):
        columns &= set(TRL_SIGNATURE_COLUMNS)
    passed = (columns - NOT_REWARD_COLUMNS) | TRL_REWARD_KWARGS
    for index, fn in enumerate(funcs):
        if isinstance(fn, str) or (isinstance(fn, torch.nn.Module) and not is_tensor_reward(fn)):
            continue
        target = fn
        while isinstance(target, functools.partial):
            target = target.func
        if isinstance(target, TensorReward):
            score = target.fn if isinstance(target, _FunctionTensorReward) else target.score  # @tensor_reward or class
            missing = _missing_arguments(score if fn is target else fn, passed, skip_positional=2)
            missing += [c for c in target.required_columns if c not in columns and c not in missing]
        elif is_tensor_reward(fn):
            missing = _missing_arguments(fn, passed | {"completion_ids", "completion_mask"})
        else:
            missing = _missing_arguments(fn, passed)
        if missing:
            hint = (
                " (remove_unused_columns=True drops every column but 'prompt': set it to False)"
                if args is not None and getattr(args, "remove_unused_columns", False)
                else ""
            )
            raise ValueError(
                f"reward_funcs[{index}] ('{_reward_name(fn)}') needs the dataset column(s) {missing}, which "
                f"train_dataset does not pass to it (its columns: {sorted(dataset_columns)}){hint}. Add the column "
                "to the dataset, or give the parameter a default."
            )


# ------------------------------------------------------------------------------------------------------- datasets
def dataset_columns(dataset: Any) -> list[str] | None:
    """The dataset's column names, when known without reading it (a `datasets` dataset; None for others and for a
    streaming dataset that does not know them)."""
    names = getattr(dataset, "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else None


def _prompt_problem(prompt: Any) -> str | None:
    """Why a prompt value cannot be generated from, or None."""
    if isinstance(prompt, str):
        return "is an empty string" if not prompt else None
    if isinstance(prompt, list):
        if not prompt:
            return "is an empty conversation (no messages)"
        for message in prompt:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                return f"has a message {message!r} that is not a dict with 'role' and 'content'"
        return None
    return f"is {prompt!r} ({type(prompt).__name__}), not a string or a list of messages"


def check_prompt_values(prompts: Sequence[Any], first_row: int | None = 0) -> None:
    """Every prompt is a non-empty string or a non-empty conversation (a list of {'role', 'content'} messages).
    `first_row`: the dataset row of the first prompt, or None when unknown (a batch drawn by the generation process)."""
    for offset, prompt in enumerate(prompts):
        problem = _prompt_problem(prompt)
        if problem is not None:
            where = f"train_dataset row {first_row + offset}" if first_row is not None else "A row of this batch"
            raise ValueError(
                f"{where}: its 'prompt' {problem}. Each prompt must be a non-empty "
                "string or a list of {'role': ..., 'content': ...} messages; fix or drop the row (e.g. "
                "`dataset.filter(lambda row: row['prompt'])`)."
            )


def check_train_dataset(dataset: Any, args) -> None:
    """The dataset has a 'prompt' column, enough prompts for one generation batch, and (for up to `UPFRONT_ROWS`
    rows) usable prompt values."""
    if dataset is None:
        return
    columns = dataset_columns(dataset)
    if columns is not None and "prompt" not in columns:
        candidates = [c for c in columns if c in ("question", "problem", "query", "input", "instruction", "text")]
        rename = f" (e.g. `dataset.rename_column({candidates[0]!r}, 'prompt')`)" if candidates else ""
        raise ValueError(
            f"train_dataset has no 'prompt' column (its columns: {columns}). GRPO generates from the 'prompt' column: "
            f"rename the column holding the prompts to 'prompt'{rename}."
        )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return  # an iterable dataset: its prompts are checked batch by batch
    rows = len(dataset)
    generation_batch_size = getattr(args, "generation_batch_size", None)
    num_generations = getattr(args, "num_generations", None) or 1
    if rows == 0:
        raise ValueError("train_dataset is empty: training would take no step. Pass a dataset with prompts.")
    if generation_batch_size:
        needed = generation_batch_size // num_generations
        if rows < needed:
            raise ValueError(
                f"train_dataset has {rows} prompt(s), but one generation batch needs {needed} different prompts "
                f"(generation_batch_size={generation_batch_size} / num_generations={num_generations}): training would "
                "take no step. Add prompts, or lower per_device_train_batch_size (or steps_per_generation)."
            )
    import datasets

    if isinstance(dataset, datasets.Dataset) and "prompt" in dataset.column_names:
        check_prompt_values(dataset[: min(rows, UPFRONT_ROWS)]["prompt"])


def check_prompt_ids(
    prompt_ids: Sequence[Sequence[int]],
    context: int | None,
    first_row: int | None = None,
    prompts: Sequence[Any] | None = None,
) -> None:
    """No prompt is empty once tokenized, and each leaves room for at least one completion token in the model's
    context. `first_row`: the dataset row of the first prompt, when known; else `prompts` (the error quotes it)."""
    for offset, ids in enumerate(prompt_ids):
        if first_row is not None:
            where = f"train_dataset row {first_row + offset}"
        else:
            quoted = repr(prompts[offset])[:80] if prompts is not None else "?"
            where = f"A prompt of this batch ({quoted})"
        if len(ids) == 0:
            raise ValueError(
                f"{where}: its prompt tokenizes to no token at all. Fix or drop the row (e.g. "
                "`dataset.filter(lambda row: row['prompt'])`)."
            )
        if context is not None and len(ids) >= context:
            raise ValueError(
                f"{where}: its prompt has {len(ids)} tokens, but the model's context is {context} tokens "
                f"(max_position_embeddings), which leaves no room for a completion. Shorten or drop the prompts of "
                f"{context} tokens or more (e.g. with `dataset.filter`), or use a model with a longer context."
            )


def check_prompt_lengths(tokenize, dataset: Any, context: int | None, max_completion_length: int | None) -> None:
    """Tokenizes the prompts of a map-style dataset (its first `UPFRONT_ROWS` rows) with the trainer's own
    tokenization (`tokenize(prompts) -> list of id lists`) and checks them with `check_prompt_ids`. Logs a warning
    when a prompt plus `max_completion_length` exceeds the context: such completions run past the positions the
    model was trained on."""
    import datasets

    if context is None or not isinstance(dataset, datasets.Dataset) or "prompt" not in dataset.column_names:
        return
    rows = min(len(dataset), UPFRONT_ROWS)
    longest = 0
    for start in range(0, rows, 1024):
        prompts = dataset[start : min(start + 1024, rows)]["prompt"]
        prompt_ids = tokenize(prompts)
        check_prompt_ids(prompt_ids, context, first_row=start)
        longest = max(longest, *(len(ids) for ids in prompt_ids))
    if max_completion_length and longest + max_completion_length > context:
        logger.warning(
            "trl_async: the longest prompt has %d tokens; with max_completion_length=%d a completion can run past the "
            "model's context of %d tokens (max_position_embeddings), where its outputs are unreliable. Lower "
            "max_completion_length to %d or shorten the prompts.",
            longest,
            max_completion_length,
            context,
            context - longest,
        )


# ------------------------------------------------------------------------------------------------------- checkpoints
def run_geometry(args, num_processes: int, dataset: Any) -> dict:
    """What decides the prompt stream's rows: saved with the stream's position, compared when resuming."""
    return {
        "num_processes": int(num_processes),
        "generation_batch_size": int(args.generation_batch_size),
        "num_generations": int(args.num_generations),
        "seed": int(args.seed),
        "shuffle_dataset": bool(getattr(args, "shuffle_dataset", True)),
        "dataset_rows": len(dataset) if hasattr(dataset, "__len__") else None,
    }


def read_rollout_checkpoint(checkpoint_dir: str) -> list[dict] | None:
    """The per-rank states of `trl_async_rollout.json` in `checkpoint_dir` (None when the file is absent), checked:
    a file that is not what the trainer writes is an error that names it."""
    path = os.path.join(checkpoint_dir, ROLLOUT_CHECKPOINT_FILE)
    if not os.path.exists(path):
        return None
    todo = (
        "Resume from another checkpoint, or delete the file to resume with the prompt stream restarted from its "
        "first batch."
    )
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read ({type(error).__name__}: {error}). {todo}") from error
    ranks = content.get("ranks") if isinstance(content, dict) else None
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, dict) and isinstance(r.get("stream_position"), int) for r in ranks)
    ):
        raise ValueError(
            f"{path} is not a trl_async rollout state (expected {{'ranks': [{{'stream_position': int, ...}}, ...]}}). "
            f"{todo}"
        )
    return ranks


def check_resume_checkpoint(checkpoint_dir: str, model: Any, current_geometry: dict | None) -> None:
    """A checkpoint to resume from was written by a run like this one: its rollout state is readable, its prompt
    stream was laid out by the same settings, and its weights fit the model."""
    ranks = read_rollout_checkpoint(checkpoint_dir)
    saved = (ranks[0].get("run") if ranks else None) or None
    if saved and current_geometry:
        differences = [
            f"{key}={saved[key]!r} there, {current_geometry[key]!r} now"
            for key in RUN_GEOMETRY
            if key in saved and saved[key] != current_geometry.get(key)
        ]
        if differences:
            raise ValueError(
                f"{os.path.join(checkpoint_dir, ROLLOUT_CHECKPOINT_FILE)} was written by a run with other settings "
                f"({'; '.join(differences)}): its prompt stream position means other rows under these. Resume with "
                "the settings of that run, or start a new run (a new output_dir, no resume_from_checkpoint)."
            )
    config_path = os.path.join(checkpoint_dir, "config.json")
    config = getattr(model, "config", None)
    if config is None or not os.path.exists(config_path) or hasattr(model, "peft_config"):
        return
    try:
        with open(config_path) as f:
            saved_config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return  # transformers reports an unreadable checkpoint itself
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    saved_text = saved_config.get("text_config", saved_config)
    differences = [
        f"{key}={saved_text[key]!r} there, {getattr(text, key)!r} in the model"
        for key in WEIGHT_SHAPE_KEYS
        if key in saved_text and hasattr(text, key) and saved_text[key] != getattr(text, key)
    ]
    if differences:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint_dir!r} holds the weights of another model ({'; '.join(differences)}). "
            "Resume with the model that run trained, or point resume_from_checkpoint at a checkpoint of this model."
        )


def resume_checkpoint_dir(resume_from_checkpoint: Any, output_dir: str) -> str | None:
    """The folder `Trainer.train(resume_from_checkpoint=...)` resumes from (`True`: the last one in `output_dir`), or
    None (no resume, or nothing to resume from: transformers reports that itself)."""
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if isinstance(resume_from_checkpoint, str) and os.path.isdir(resume_from_checkpoint):
        return resume_from_checkpoint
    return None


# ------------------------------------------------------------------------------------------------------- entry points
def check_inputs_before_init(args, model: Any, reward_funcs: Any, train_dataset: Any) -> None:
    """What `AsyncGRPOTrainer.__init__` checks before `GRPOTrainer.__init__` loads anything."""
    check_sampling_settings(args)
    if getattr(args, "async_generation", True):
        check_generation_device(getattr(args, "generation_device", None))
        check_vllm_installed(args)
    check_model_id(model, args)
    check_train_dataset(train_dataset, args)
    check_reward_funcs(reward_funcs, args, dataset_columns(train_dataset))


def check_inputs_after_init(trainer) -> None:
    """What `AsyncGRPOTrainer.__init__` checks once `GRPOTrainer.__init__` has set up the tokenizer and the model (still
    before any generation process starts)."""
    check_eos_and_pad(trainer.processing_class)
    tokenize = getattr(trainer, "_tokenize_prompts", None)
    # Image prompts and per-environment tool schemas are tokenized batch by batch only (TRL's synchronous path).
    text_only = not getattr(trainer, "_is_vlm", False) and getattr(trainer, "environment_factories", None) is None
    if tokenize is not None and text_only:
        check_prompt_lengths(
            lambda prompts: tokenize(prompts)[0],
            trainer.train_dataset,
            context_length(getattr(trainer.model, "config", None)),
            getattr(trainer.args, "max_completion_length", None),
        )


def check_resume(trainer, resume_from_checkpoint: Any) -> None:
    """What `AsyncGRPOTrainer.train` checks before resuming (before transformers loads the checkpoint)."""
    checkpoint = resume_checkpoint_dir(resume_from_checkpoint, trainer.args.output_dir)
    if checkpoint is None:
        return
    geometry = run_geometry(trainer.args, trainer.accelerator.num_processes, trainer.train_dataset)
    check_resume_checkpoint(checkpoint, trainer.accelerator.unwrap_model(trainer.model), geometry)
