"""Everything the trainers assume about TRL's private `GRPOTrainer` API, in one place (TRL 1.16).

TRL ships a minor release every few weeks, and its private methods change between them; TRL itself removed GFPO, PAPO
and DPPO because their overrides drifted silently. The trainers override a few of TRL's methods (`HOOKS`), read one
tuple layout (`GENERATE_FIELDS`), rely on two call orders (`CALL_ORDER`) and on when TRL computes π_old at batch time
(`computes_old_logps`). With tools, environments or a rollout function, the generation process runs TRL's multi-turn
methods on a host object that provides what they read of `self` (`TOOL_LOOP_HOST_ATTRIBUTES`, `TOOL_LOOP_FIELDS`),
and the trainers read what TRL's `__init__` set up for them (`AGENTIC_TRAINER_ATTRIBUTES`). `tests/test_trl_contract.py` checks each
of these against the installed TRL, so an upgrade that changes one fails that test, naming what changed, instead of
failing silently in training. `check_hooks()` runs the signature part when a trainer class is first built and warns.
"""

from __future__ import annotations

import inspect
import warnings

# The 8-tuple `GRPOTrainer._generate(prompts)` returns, in order.
GENERATE_FIELDS = (
    "prompt_ids",
    "completion_ids",
    "tool_mask",
    "completions",
    "logprobs",
    "extra_fields",
    "images",
    "tool_images",
)

# The TRL methods the trainers override or call by name, with the leading parameters they rely on (TRL may add more
# keyword parameters after these without breaking anything).
HOOKS = {
    "__init__": ("self", "model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class"),
    "get_train_dataloader": ("self",),
    "_generate_and_score_completions": ("self", "inputs"),
    "_generate": ("self", "prompts"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "_compute_loss": ("self", "model", "inputs"),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    "log": ("self", "logs", "start_time"),
    "evaluation_loop": (
        "self",
        "dataloader",
        "description",
        "prediction_loss_only",
        "ignore_keys",
        "metric_key_prefix",
    ),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    # TRL's multi-turn code, which the generation process runs as functions on `rollout.agentic.ToolLoopHost`
    # (`_generate` above is one of them), and the two the host replaces.
    "_tokenize_prompts": ("self", "prompts"),
    "_tool_call_loop": (
        "self",
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ),
    "_get_tool_suffix_ids": ("self", "tool_messages"),
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations"),
}

# What TRL's multi-turn methods read of `self`, per method (`ast` over their source). `rollout.agentic.ToolLoopHost`
# provides each of them in the generation process; `host_attribute_mismatches` names any TRL starts or stops reading.
TOOL_LOOP_HOST_ATTRIBUTES = {
    "_generate": (
        "_batch_environments", "_env_tools", "_generate_single_turn", "_last_loaded_step", "_metrics",
        "_tokenize_prompts", "_tokenizer", "_tool_call_loop", "accelerator", "environment_factories", "eos_token_ids",
        "model", "num_generations", "num_generations_eval", "processing_class", "rollout_func", "state", "tools",
        "use_vllm", "vllm_generation",
    ),
    "_tokenize_prompts": (
        "_batch_environments", "_env_tools", "_is_vlm", "chat_template", "chat_template_kwargs",
        "environment_factories", "processing_class", "tools",
    ),
    "_tool_call_loop": (
        "_async_tool_dicts", "_batch_environments", "_env_tools", "_generate_single_turn", "_get_tool_suffix_ids",
        "_is_vlm", "_sync_tool_dicts", "_tokenizer", "async_loop", "environment_factories", "max_completion_length",
        "max_tool_calling_iterations", "model", "processing_class", "tools", "use_vllm", "vllm_generation", "vllm_mode",
    ),
    "_get_tool_suffix_ids": ("_is_vlm", "_tokenizer", "chat_template", "chat_template_kwargs", "processing_class"),
}  # fmt: skip

# The 7-tuple `GRPOTrainer._tool_call_loop` returns, in order.
TOOL_LOOP_FIELDS = (
    "tool_mask",
    "completions",
    "completion_ids",
    "logprobs",
    "tool_call_count",
    "tool_failure_count",
    "tool_images",
)

# What the trainers read of a `GRPOTrainer` that `__init__` gave tools, environments or a rollout function
# (`trainers.rollout_spec.agentic_spec`, `trainers.agentic`); `environment_factories` and `environments` are also
# set to None for the length of TRL's scoring of a rollout batch (`environments_left_to_the_rollouts`).
AGENTIC_TRAINER_ATTRIBUTES = (
    "_standalone_tools",
    "environment_factories",
    "_multi_environment",
    "environments",
    "rollout_func",
    "tools",
    "max_tool_calling_iterations",
    "max_completion_length",
    "_metrics",
)

# The call orders the one hand-off slot (`engine.HookSlot`) relies on, checked by running TRL's own methods.
CALL_ORDER = {
    "_generate_and_score_completions": "calls _generate(prompts) once, then _calculate_rewards(...) once, and "
    "returns the batch dict; nothing else reads the rollout batch",
    "_compute_loss": "calls _get_per_token_logps_and_entropies(model, ...) for the policy first, and reads "
    "inputs['advantages'] only after it",
}


def computes_old_logps(args) -> bool:
    """Whether TRL's `_generate_and_score_completions` computes `old_per_token_logps` (π_old at batch time) for a batch
    of this config: when the batch is used across optimizer steps, i.e. `gradient_accumulation_steps` is not a multiple
    of `steps_per_generation * num_iterations` (TRL 1.16; its other case, its own vLLM generation with the importance
    correction, never runs in an asynchronous step). A config condition, the same on every rank."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0


def generate_result(**fields) -> tuple:
    """The tuple `GRPOTrainer._generate` returns, from its fields by name (every one of `GENERATE_FIELDS`)."""
    missing, unknown = set(GENERATE_FIELDS) - set(fields), set(fields) - set(GENERATE_FIELDS)
    if missing or unknown:
        raise TypeError(f"generate_result: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return tuple(fields[name] for name in GENERATE_FIELDS)


def generate_fields(result: tuple) -> dict:
    """The fields of a `GRPOTrainer._generate` result, by name."""
    if len(result) != len(GENERATE_FIELDS):
        raise TypeError(f"GRPOTrainer._generate returned {len(result)} values; trl_async expects {GENERATE_FIELDS}")
    return dict(zip(GENERATE_FIELDS, result, strict=True))


def tool_loop_fields(result: tuple) -> dict:
    """The fields of a `GRPOTrainer._tool_call_loop` result, by name."""
    if len(result) != len(TOOL_LOOP_FIELDS):
        raise TypeError(
            f"GRPOTrainer._tool_call_loop returned {len(result)} values; trl_async expects {TOOL_LOOP_FIELDS}"
        )
    return dict(zip(TOOL_LOOP_FIELDS, result, strict=True))


def self_attribute_reads(function) -> set[str]:
    """The attributes a method reads or writes on `self` (`self.<name>`), from its source."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }


def _methods_named(trainer_class, expectations: dict, mismatches: list[str]):
    """(name, expected, method) for each name of `expectations` that `trainer_class` has; '<name>: missing' goes to
    `mismatches` for each it lacks."""
    for name, expected in expectations.items():
        method = getattr(trainer_class, name, None)
        if method is None:
            mismatches.append(f"{name}: missing")
        else:
            yield name, expected, method


def host_attribute_mismatches(trainer_class) -> list[str]:
    """TRL's multi-turn methods whose `self.<name>` reads differ from `TOOL_LOOP_HOST_ATTRIBUTES`, by name."""
    mismatches = []
    for method, expected, function in _methods_named(trainer_class, TOOL_LOOP_HOST_ATTRIBUTES, mismatches):
        reads = self_attribute_reads(function)
        new, gone = sorted(reads - set(expected)), sorted(set(expected) - reads)
        if new:
            mismatches.append(f"{method} now reads self.{', self.'.join(new)}")
        if gone:
            mismatches.append(f"{method} no longer reads self.{', self.'.join(gone)}")
    return mismatches


def hook_mismatches(trainer_class) -> list[str]:
    """The hooks of `trainer_class` (TRL's `GRPOTrainer`) whose leading parameters differ from `HOOKS`."""
    mismatches = []
    for name, expected, method in _methods_named(trainer_class, HOOKS, mismatches):
        parameters = tuple(inspect.signature(method).parameters)[: len(expected)]
        if parameters != expected:
            mismatches.append(f"{name}{parameters}: expected {expected}")
    return mismatches


def check_hooks(trainer_class) -> None:
    """Warn once per class when the installed TRL's hooks differ from what the trainers were written against."""
    mismatches = hook_mismatches(trainer_class)
    if mismatches:
        import trl

        warnings.warn(
            f"trl_async was written against TRL 1.16's GRPOTrainer; the installed TRL {trl.__version__} differs in: "
            + "; ".join(mismatches)
            + ". Install trl>=1.16,<1.17 (pyproject.toml) or expect wrong results.",
            RuntimeWarning,
            stacklevel=3,
        )


def bind_init(*args, **kwargs) -> inspect.BoundArguments:
    """`GRPOTrainer.__init__`'s arguments bound by name (`self` as None), so that they can be read and replaced."""
    from trl import GRPOTrainer

    return inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs)


# ------------------------------------------------------------------------------------------------------- config
def finish_grpo_config(args, *, require_groups: bool) -> None:
    """`GRPOConfig.__post_init__` (TRL 1.16): its base's post-init (TRL's `_BaseConfig`, then `TrainingArguments`),
    TRL's normalisations and checks, and the batch geometry (`generation_batch_size`, `steps_per_generation`) the
    trainer reads.

    `require_groups=False` leaves out one check, `num_generations >= 2`: GRPO's group baseline needs two completions
    per prompt, PPO's baseline is its critic. `AsyncPPOConfig` uses it; `tests/test_trl_contract.py` checks that with
    `require_groups=True` every field and every error equals `GRPOConfig.__post_init__`'s, over a grid of settings.
    """
    from trl.trainer.base_config import _BaseConfig

    _BaseConfig.__post_init__(args)
    _normalise_grpo_fields(args)
    _refuse_grpo_settings(args)
    _derive_generation_batch(args)
    _check_groups(args, require_groups)
    _check_importance_sampling(args)


def _normalise_grpo_fields(args) -> None:
    if isinstance(args.pad_to_multiple_of, str) and args.pad_to_multiple_of != "auto":  # the CLI passes a string
        args.pad_to_multiple_of = (
            None if args.pad_to_multiple_of.lower() in ("none", "null") else int(args.pad_to_multiple_of)
        )
    if args.pad_to_multiple_of == "auto":
        args.pad_to_multiple_of = 128 if args.device.type == "neuron" else None
    if args.use_transformers_paged:
        warnings.warn(
            "`use_transformers_paged` is deprecated and will be removed in v2.0.0. Use "
            "`use_transformers_continuous_batching` instead.",
            FutureWarning,
            stacklevel=4,
        )
        args.use_transformers_continuous_batching = True
    args.scale_rewards = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)


def _refuse_grpo_settings(args) -> None:
    parallelism = args.parallelism_config
    if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
        raise ValueError(
            "GRPOTrainer does not support sequence-dim parallelism (`parallelism_config.cp_size > 1` or "
            "`parallelism_config.sp_size > 1`) yet. Set both `cp_size=1` and `sp_size=1`, or disable "
            "`parallelism_config`."
        )
    if args.log_completions_hub_repo is not None and not args.log_completions:
        raise ValueError(
            "log_completions_hub_repo is set, but log_completions is False. Enable log_completions to upload "
            "completions to the Hub, or unset log_completions_hub_repo."
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size is not supported by GRPO, because the generation batch must contain full prompt "
            "groups of num_generations completions, and reducing the batch size on out-of-memory breaks this "
            "invariant. Set auto_find_batch_size=False and lower per_device_train_batch_size instead."
        )


def _derive_generation_batch(args) -> None:
    global_batch = args.per_device_train_batch_size * args.world_size
    if args.generation_batch_size is None and args.steps_per_generation is None:
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = global_batch * args.steps_per_generation
    elif args.generation_batch_size is not None and args.steps_per_generation is None:
        if args.generation_batch_size % global_batch != 0:
            raise ValueError(
                f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global batch size "
                f"({global_batch})."
            )
        args.steps_per_generation = args.generation_batch_size // global_batch
    elif args.generation_batch_size is None and args.steps_per_generation is not None:
        args.generation_batch_size = global_batch * args.steps_per_generation
    else:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
        )


def _check_groups(args, require_groups: bool) -> None:
    if args.do_eval and args.eval_strategy != "no":
        num_generations = args.num_generations_eval or args.num_generations
        if (args.per_device_eval_batch_size * args.world_size) % num_generations != 0:
            raise ValueError(
                f"The global eval batch size ({args.per_device_eval_batch_size} * {args.world_size}) must be "
                f"divisible by the number of generations used for evaluation ({num_generations})."
            )
    if args.generation_batch_size % args.num_generations != 0:
        raise ValueError(
            f"generation_batch_size ({args.generation_batch_size}) must be divisible by num_generations "
            f"({args.num_generations})."
        )
    if require_groups and args.num_generations < 2:
        raise ValueError(
            "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{args.num_generations}, which is less than the minimum required."
        )


def _check_importance_sampling(args) -> None:
    if args.vllm_importance_sampling_cap is not None:
        warnings.warn(
            "The `vllm_importance_sampling_cap` argument is deprecated and will be removed in v2.0.0. "
            "Use `vllm_importance_sampling_clip_max` instead.",
            FutureWarning,
            stacklevel=4,
        )
        args.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_cap
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({low}) must be less than vllm_importance_sampling_clip_max ({high})."
        )
    if (
        args.vllm_importance_sampling_correction
        and args.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")
        and low is None
        and high is None
    ):
        raise ValueError(
            "At least one of `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_clip_max` must be set "
            "when `vllm_importance_sampling_mode` is a `*_truncate` mode."
        )
