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

import inspect
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..rollout.prompts import check_prompt_ids, check_prompt_values, context_length

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


# ------------------------------------------------------------------------------------------------------- rewards


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
    from ..rewards.base import TensorReward, _FunctionTensorReward, is_tensor_reward, unwrap_partial
    from ..rewards.runner import reward_name

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
        target = unwrap_partial(fn)
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
                f"reward_funcs[{index}] ('{reward_name(fn)}') needs the dataset column(s) {missing}, which "
                f"train_dataset does not pass to it (its columns: {sorted(dataset_columns)}){hint}. Add the column "
                "to the dataset, or give the parameter a default."
            )


# ------------------------------------------------------------------------------------------------------- datasets
def dataset_columns(dataset: Any) -> list[str] | None:
    """The dataset's column names, when known without reading it (a `datasets` dataset; None for others and for a
    streaming dataset that does not know them)."""
    names = getattr(dataset, "column_names", None)
    return list(names) if isinstance(names, (list, tuple)) else None


def check_train_dataset(dataset: Any, args, prompt_required: bool = True) -> None:
    """The dataset has a 'prompt' column, enough prompts for one generation batch, and (for up to `UPFRONT_ROWS`
    rows) usable prompt values. With an `environment_factory` the prompt is optional, as in TRL: the environment's
    `reset` supplies it."""
    if dataset is None:
        return
    columns = dataset_columns(dataset)
    if columns is not None and "prompt" not in columns and prompt_required:
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
# ------------------------------------------------------------------------------------------------------- entry points
def check_inputs_before_init(
    args, model: Any, reward_funcs: Any, train_dataset: Any, environment_factory: Any = None, rollout_func: Any = None
) -> None:
    """What `AsyncGRPOTrainer.__init__` checks before `GRPOTrainer.__init__` loads anything. A `rollout_func`'s
    extra fields reach the reward functions too (TRL merges them into the rows), so with one the reward functions'
    columns cannot be judged from the dataset's."""
    check_sampling_settings(args)
    if getattr(args, "async_generation", True):
        check_generation_device(getattr(args, "generation_device", None))
        check_vllm_installed(args)
    check_model_id(model, args)
    check_train_dataset(train_dataset, args, prompt_required=environment_factory is None)
    check_reward_funcs(reward_funcs, args, None if rollout_func is not None else dataset_columns(train_dataset))


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
