"""What a trainer tells its rank's generation process: where it runs (`placement`) and what it needs to make rollouts
as TRL would (`generator_spec`): TRL's sampling settings, prompt order, reward callables and the backend's options.

Functions of the trainer, read once when the generation process starts (the first training batch).
"""

from __future__ import annotations

import logging
import os

import torch

from ..config import async_field
from ..config.grpo import items_per_decode, rows_per_generation_batch
from ..config.refusals import model_config_of
from ..rewards import is_tensor_reward
from ..rollout import GeneratorSpec, ModelSpec
from ..rollout.agentic import AgenticSpec
from ..rollout.placement import Placement, choose_placement, rank_cores
from ..rollout.prompts import is_iterable_dataset
from ..timeline import TimelineSpec

logger = logging.getLogger(__name__)


def placement(trainer) -> Placement:
    """Where this rank's generation process runs, and the split of the rank's thread budget (`OMP_NUM_THREADS`, an
    earlier `torch.set_num_threads`, or its cores) between it and the trainer (`rollout.placement`)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.accelerator.num_processes))
    where = choose_placement(
        trainer.args.generation_device,
        trainer.accelerator.device,
        trainer.args.generation_num_threads,
        rank_cores(local_world),
        os.environ.get("OMP_NUM_THREADS"),
        lend_idle_cores=trainer.args.lend_idle_cores,
        torch_threads=torch.get_num_threads(),
    )
    if where.note is not None:
        logger.warning(where.note)
    elif where.budget is not None:
        logger.info(
            "trl_async: thread budget %d (%s): %d for the trainer, %d for its generation process",
            where.budget, where.budget_source, where.trainer_threads, where.generator_threads,
        )  # fmt: skip
    return where


def generator_spec(trainer, where: Placement) -> GeneratorSpec:
    """What this rank's generation process needs: TRL's sampling settings, prompt order and reward callables."""
    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    base = model.get_base_model() if is_peft else model
    reward_models = [isinstance(f, torch.nn.Module) and not is_tensor_reward(f) for f in trainer.reward_funcs]
    any_text_reward = any(
        not is_tensor_reward(f) and not m for f, m in zip(trainer.reward_funcs, reward_models, strict=True)
    )
    return GeneratorSpec(
        process_index=trainer.accelerator.process_index,
        num_processes=trainer.accelerator.num_processes,
        device=where.device,
        num_threads=where.generator_threads,
        backend=backend_name(args),
        backend_options=backend_options(args, where, agentic=uses_agentic_rollouts(trainer)),
        model_spec=ModelSpec(
            config=base.config,
            dtype=next(base.parameters()).dtype,
            peft_config=model.peft_config[model.active_adapter] if is_peft else None,
            adapter_name=model.active_adapter if is_peft else "default",
            generation_defaults=getattr(base, "generation_config", None),
        ),
        generation_config=trainer.generation_config,
        temperature=trainer.temperature,
        eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id,
        processing_class=trainer.processing_class,
        chat_template=trainer.chat_template,
        chat_template_kwargs=dict(trainer.chat_template_kwargs or {}),
        dataset=trainer.train_dataset,
        num_generations=trainer.num_generations,
        generation_batch_size=args.generation_batch_size,
        shuffle=trainer.shuffle_dataset,
        seed=args.seed,
        reward_funcs=[
            None if is_model else f for f, is_model in zip(trainer.reward_funcs, reward_models, strict=True)
        ],
        reward_func_names=list(trainer.reward_func_names),
        decode=bool(args.log_completions) or any(reward_models) or any_text_reward or uses_agentic_rollouts(trainer),
        parent_pid=os.getpid(),
        columns=_kept_columns(trainer),
        inflight_weight_updates=bool(args.inflight_weight_updates),
        timeline=timeline_spec(trainer),
        agentic=agentic_spec(trainer),
        items_per_decode=items_per_decode(args, agentic=uses_agentic_rollouts(trainer)),
    )


def modeling_modules(model, args, peft_config=None) -> list[str]:
    """The modules that define the model's architecture (`transformers.models.qwen2.modeling_qwen2`), and PEFT's for
    an adapter: a generation process that imports them ahead (`rollout.generator.warm_up_generator_start`) builds its
    model seconds sooner (5 s of Qwen2's on a loaded 2-core machine). Best effort: a name that does not import is
    skipped there."""
    adapter = ["peft"] if peft_config is not None or hasattr(model, "peft_config") else []
    if not isinstance(model, str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return [type(base).__module__, *adapter]
    config = model_config_of(model, args)
    model_type = getattr(config, "model_type", None)
    return ([f"transformers.models.{model_type}.modeling_{model_type}"] if model_type else []) + adapter


def uses_agentic_rollouts(trainer) -> bool:
    """Tools, an environment factory or a rollout function: TRL's multi-turn generation (the same on every rank)."""
    return bool(getattr(trainer, "tools", None)) or any(
        getattr(trainer, name, None) is not None for name in ("environment_factories", "rollout_func")
    )


def agentic_spec(trainer) -> AgenticSpec | None:
    """What the generation process needs to run the trainer's tools, environments and rollout function as TRL runs
    them (`rollout.agentic`), read from the attributes TRL's `__init__` set (`trl_contract.AGENTIC_TRAINER_ATTRIBUTES`);
    None without them."""
    if not uses_agentic_rollouts(trainer):
        return None
    return AgenticSpec(
        tools=list(trainer._standalone_tools),
        environment_factories=trainer.environment_factories,
        multi_environment=bool(trainer._multi_environment),
        rollout_func=trainer.rollout_func,
        max_tool_calling_iterations=trainer.max_tool_calling_iterations,
        max_completion_length=trainer.max_completion_length,
        tool_timeout=async_field(trainer.args, "tool_timeout"),
        tool_call_threads=async_field(trainer.args, "tool_call_threads"),
        args=trainer.args,
    )


def timeline_spec(trainer) -> TimelineSpec | None:
    """Where and how the generation process records its timeline (None with `timeline=False`): the trainer's output
    folder, sampling policy and first step, so both processes of a rank keep the same steps."""
    recorder = trainer._timeline
    if not recorder.enabled:
        return None
    return TimelineSpec(trainer.args.output_dir, policy=recorder.policy, first_step=recorder.first_step)


def _kept_columns(trainer) -> list[str] | None:
    """The dataset columns `Trainer` would have kept (`remove_unused_columns`), or None for all of them."""
    if not trainer.args.remove_unused_columns or is_iterable_dataset(trainer.train_dataset):
        return None
    import datasets

    if not isinstance(trainer.train_dataset, datasets.Dataset):
        return None
    trainer._set_signature_columns_if_needed()
    return list(trainer._signature_columns)


def backend_name(args) -> str:
    if args.generation_backend == "vllm":
        return "vllm-server" if args.vllm_mode == "server" else "vllm"
    return args.generation_backend


# The server backend's options (`VLLMServerBackend`), from TRL's `vllm_server_*` fields of the same meaning.
VLLM_SERVER_OPTIONS = {
    "base_url": "vllm_server_base_url",
    "host": "vllm_server_host",
    "port": "vllm_server_port",
    "group_port": "vllm_group_port",
    "connection_timeout": "vllm_server_timeout",
    "sampling_overrides": "generation_kwargs",
}


def uses_cuda_graphs(args, device) -> bool:
    """`generation_cuda_graphs`: 'auto' is on where the hf backend generates on a CUDA device (refusals check 'on')."""
    setting = async_field(args, "generation_cuda_graphs")
    return args.generation_backend == "hf" and (
        setting == "on" or (setting == "auto" and torch.device(device).type == "cuda")
    )


def backend_options(args, where: Placement, agentic: bool = False) -> dict:
    """The hf backend's in-flight updates and CUDA graphs (padded to the rows of one decode); TRL's vLLM knobs,
    honoured by the vLLM backends (docs/vllm.md has the table)."""
    if args.generation_backend != "vllm":
        options = {"inflight_weight_updates": True} if args.inflight_weight_updates else {}
        if uses_cuda_graphs(args, where.device):
            options["cuda_graphs"] = True
            options["decode_rows"] = items_per_decode(args, agentic=agentic) * rows_per_generation_batch(args)
        return options
    if args.vllm_mode == "server":
        return {option: getattr(args, field) for option, field in VLLM_SERVER_OPTIONS.items()}
    engine_kwargs = {"model_impl": args.vllm_model_impl} if args.vllm_model_impl != "vllm" else {}
    if args.vllm_enable_sleep_mode:
        engine_kwargs["enable_sleep_mode"] = True
    options = dict(
        max_model_len=args.vllm_max_model_length,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        engine_seed=args.seed,
        sampling_overrides=args.generation_kwargs,
        engine_kwargs=engine_kwargs or None,
    )
    if torch.device(where.device).type == "cuda":  # on CPU vLLM sizes its KV cache in bytes instead
        options["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
    return options
