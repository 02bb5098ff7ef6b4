"""Up-front refusals: what asynchronous generation does not support yet, checked before any heavy set-up.

These checks run before `GRPOTrainer.__init__`, on the constructor's own arguments, so that nothing (a colocated vLLM
engine, a model download, a reward model) starts before a clear error. Each error names the setting and says what to
do instead. A plain `async_generation=False` always remains: TRL's synchronous path supports everything TRL does.
"""

from __future__ import annotations

import os

from ..rollout.gather import FSDP1_MESSAGE

ASYNC_OFF = "set async_generation=False (AsyncGRPOConfig) to run TRL's synchronous generation with it"


def model_config_of(model, args):
    """The model's config without loading weights (a `str` model: its config file only)."""
    if not isinstance(model, str):
        return getattr(model, "config", None)
    try:
        from transformers import AutoConfig

        kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        return AutoConfig.from_pretrained(
            model, revision=kwargs.get("revision"), trust_remote_code=getattr(args, "trust_remote_code", False)
        )
    except Exception:  # an unreachable Hub etc.: TRL's own loading reports it
        return None


def _is_quantized(model, args, quantization_config) -> bool:
    if quantization_config is not None:
        return True
    kwargs = getattr(args, "model_init_kwargs", None) or {}
    if any(kwargs.get(k) for k in ("quantization_config", "load_in_4bit", "load_in_8bit")):
        return True
    if not isinstance(model, str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return bool(getattr(base, "is_quantized", False) or getattr(base, "quantization_method", None))
    return False


def _uses_fsdp1(args) -> bool:
    """FSDP1 is on: set in the training arguments (transformers' `fsdp` + `fsdp_config`, FSDP2 unless its `version` is
    1), or by `accelerate launch --use_fsdp` / an accelerate config (`FSDP_VERSION`, which defaults to 1 there).
    FSDP2 and DeepSpeed ZeRO-3 are supported: their parameters are gathered before publishing (`rollout.gather`)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)  # what the HF Trainer hands to accelerate's FSDP plugin
    if plugin_args:
        return int(plugin_args.get("fsdp_version", 2)) == 1
    if getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        return int(config.get("version", config.get("fsdp_version", 2))) == 1
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return int(os.environ.get("FSDP_VERSION", "1")) == 1
    return False


def check_async_supported(
    args,
    model,
    processing_class=None,
    quantization_config=None,
    tools=None,
    rollout_func=None,
    environment_factory=None,
) -> None:
    """Raise `ValueError` naming every setting that asynchronous generation does not support yet."""
    reasons = []
    if getattr(args, "use_vllm", False):
        reasons.append(
            "use_vllm=True: TRL's vLLM generation would run in the training process; asynchronous generation has "
            "its own generation process"
        )
    agentic = agentic_arguments(tools, environment_factory, rollout_func)
    if agentic and getattr(args, "inflight_weight_updates", False):
        reasons.append(
            f"inflight_weight_updates=True with {agentic}: TRL's tool loop samples a batch's turns in several calls, "
            "and per-token weight versions are not tracked across them yet (set inflight_weight_updates=False)"
        )
    if agentic and getattr(args, "generation_backend", "hf") == "vllm":
        reasons.append(
            f"the vLLM backend (generation_backend='vllm' or use_vllm=True) with {agentic}: multi-turn generation is "
            "implemented for generation_backend='hf' only so far (set generation_backend='hf')"
        )
    from transformers import ProcessorMixin

    config = model_config_of(model, args)
    if isinstance(processing_class, ProcessorMixin) or (config is not None and hasattr(config, "vision_config")):
        reasons.append("a vision-language model (images are not sent to the generation process)")
    if _is_quantized(model, args, quantization_config):
        reasons.append(
            "a quantized base model (QLoRA / bitsandbytes): the generation process rebuilds the base from its config "
            "and would sample from an unquantized copy"
        )
    if _uses_fsdp1(args):
        reasons.append(FSDP1_MESSAGE)
    if reasons:
        raise ValueError(
            "Asynchronous generation (AsyncGRPOTrainer's default) does not support: "
            + "; ".join(reasons)
            + f". To train with these, {ASYNC_OFF}."
        )


def check_cuda_graphs(args, generation_device) -> None:
    """`generation_cuda_graphs='on'` needs the generation process on a CUDA device (CUDA graphs are CUDA's)."""
    import torch

    setting = getattr(args, "generation_cuda_graphs", "auto")
    if args.async_generation and setting == "on" and torch.device(generation_device).type != "cuda":
        raise ValueError(
            f"generation_cuda_graphs='on' needs the generation process on a CUDA device, but it runs on "
            f"{generation_device}. Set generation_cuda_graphs='auto' (on where it applies) or 'off', or "
            "generation_device='cuda:N'."
        )


def _generate_replaced(model) -> bool:
    """`model.generate` is an attribute of the instance, other than FSDP2's registration of the class's own method
    (`torch.distributed.fsdp.register_fsdp_forward_method`, which transformers' Trainer applies to `generate` under
    FSDP2 so that the parameters are gathered for it: the same method, with the gathering around it)."""
    method = vars(model).get("generate")
    if method is None:
        return False
    function = getattr(method, "__func__", method)
    # FSDP's wrapper is known by its code: `functools.wraps` gave it the wrapped method's names.
    code = getattr(function, "__code__", None)
    if (
        code is not None
        and code.co_name == "wrapped_method"
        and "torch/distributed/fsdp/" in code.co_filename.replace(os.sep, "/")
    ):
        wrapped = getattr(function, "__wrapped__", None)
        return getattr(wrapped, "__func__", None) is not getattr(type(model), "generate", None)
    return True


def check_generate_not_replaced(*models) -> None:
    """Refuse a `generate` replaced on the model instance (`unittest.mock.patch.object(trainer.model, "generate",
    ...)`, a monkey-patch), checked as asynchronous training starts: the generation process samples from its own copy
    of the model, rebuilt from the model's class, config and weights, so the replacement would be silently ignored and
    the run would train on what the unpatched model samples. `models`: `trainer.model` and its unwrapped module."""
    if any(_generate_replaced(model) for model in models if model is not None):
        raise ValueError(
            "trainer.model.generate is replaced on the model instance (a patch or a monkey-patch): asynchronous "
            "generation samples in its generation process, from its own copy of the model, which cannot call the "
            f"replacement. To use it, {ASYNC_OFF}."
        )


AGENTIC_ARGUMENTS = ("tools", "environment_factory", "rollout_func")  # `GRPOTrainer.__init__`'s, in this order


def agentic_arguments(tools=None, environment_factory=None, rollout_func=None) -> str:
    """The agentic arguments given, as a user writes them ('tools=, rollout_func='), or '' when none is."""
    given = [("tools", bool(tools)), ("environment_factory", environment_factory is not None),
             ("rollout_func", rollout_func is not None)]  # fmt: skip
    return ", ".join(f"{name}=" for name, used in given if used)


def check_agentic_trainer(trainer_name: str, tools=None, environment_factory=None, rollout_func=None) -> None:
    """`AsyncPPOTrainer` refuses tools, environments and rollout functions, whatever `async_generation` says."""
    agentic = agentic_arguments(tools, environment_factory, rollout_func)
    if agentic:
        raise ValueError(
            f"{trainer_name} does not support {agentic} yet: tool and environment turns make the loss mask of a "
            "completion non-contiguous, which GAE here does not handle. Use AsyncGRPOTrainer for agentic training."
        )


def check_m2po_supported(args, model=None) -> None:
    """M2PO replaces TRL's loss: refuse the TRL loss options it does not implement."""
    if getattr(args, "loss_type", None) != "m2po":
        return
    config = getattr(model, "config", None) if model is not None and not isinstance(model, str) else None
    unsupported = {
        "top_entropy_quantile < 1": getattr(args, "top_entropy_quantile", 1.0) < 1.0,
        "an entropy bonus (entropy_coef, use_adaptive_entropy)": bool(getattr(args, "entropy_coef", 0.0))
        or bool(getattr(args, "use_adaptive_entropy", False)),
        "off_policy_mask_threshold": getattr(args, "off_policy_mask_threshold", None) is not None,
        "importance_sampling_level='sequence'": getattr(args, "importance_sampling_level", "token") != "token",
        "a MoE router aux loss (output_router_logits)": bool(getattr(config, "output_router_logits", False)),
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"loss_type='m2po' does not support {', '.join(used)}; disable it or use loss_type='dapo'.")
