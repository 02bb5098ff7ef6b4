"""The model card of a trl_async trainer: what it shows, gathered from the trainer, and who writes it.

Every trl_async trainer writes the same card, whether the push comes from `recipes/qwen_math.py` or from a user's
own `trainer.push_to_hub()`: `ModelCardMixin` replaces TRL's `create_model_card`, which `Trainer.push_to_hub` and
TRL's checkpointing call. The card is a `huggingface_hub.ModelCard` rendered from a Jinja template, with its metadata
built as a `ModelCardData` (never YAML by hand):

* metadata: `base_model`, `library_name` (`peft` for adapters), `pipeline_tag`, `datasets`, tags (`trl`,
  `trl-async`, the trainer kind `grpo` / `ppo`, `m2po` when that loss was used, `lora` for LoRA adapters), and the
  greedy accuracy after training as a `model-index` result when the run was evaluated;
* body: how to load it, the training configuration (staleness bound, loss type, reward functions, batch geometry,
  LoRA settings), the final metrics (accuracy before/after from `eval.json`, reward of the first/last quarter of
  steps, every `async/*` and `m2po/*` metric summarised over the run), the recipe's plot when present, versions,
  and citations (M2PO when used, GRPO / PPO, TRL).

Why not TRL's `generate_model_card`: its template hard-codes `library_name: transformers` and has no place for the
configuration or results, so the card here uses the same machinery (`ModelCard.from_template` on `ModelCardData`)
with a template of its own (`template.py`), and takes the GRPO citation from TRL's `GRPOTrainer._paper`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .push import looks_like_hub_id
from .results import PLOT_FILE, metric_summaries, read_eval_results, reward_summary
from .template import CARD_TEMPLATE, M2PO_PAPER, PPO_PAPER, TRL_CITATION

TRAINER_KINDS = ("grpo", "ppo")

# Configuration fields shown on the card, in order; a field the trainer's args lack is skipped, so the PPO config
# (vf_coef, gamma, lam, ...) and future fields need no change here.
COMMON_CONFIG_FIELDS = (
    "loss_type", "async_generation", "max_staleness", "weight_sync_steps", "m2po_threshold", "m2po_rule",
    "m2po_scope", "learning_rate", "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size",
    "gradient_accumulation_steps", "steps_per_generation", "num_iterations", "max_completion_length", "temperature",
    "seed",
)  # fmt: skip
KIND_CONFIG_FIELDS = {
    "grpo": ("num_generations", "beta", "scale_rewards", "epsilon", "epsilon_high"),
    "ppo": ("vf_coef", "cliprange", "cliprange_value", "gamma", "lam", "kl_coef", "whiten_rewards"),
}
M2PO_ONLY_FIELDS = ("m2po_threshold", "m2po_rule", "m2po_scope")


@dataclass
class CardSummary:
    """Everything the card shows, gathered from a trainer (`summarize_trainer`) or built directly (tests)."""

    trainer_kind: str
    trainer_class: str
    model_name: str
    hub_model_id: str | None
    load_id: str  # what `from_pretrained` takes in the quick start: hub_model_id, else output_dir
    base_model: str | None  # a Hub id, else None
    base_model_path: str | None  # what the run loaded, when it is not a Hub id
    is_adapter: bool
    peft_type: str | None
    loss_type: str
    async_generation: bool
    max_staleness: int | None
    reward_functions: list[str]
    config: dict[str, Any]
    log_history: list[dict] = field(default_factory=list)
    global_step: int | None = None
    eval_results: dict | None = None
    dataset_name: str | None = None
    plot: str | None = None  # file name in the repo
    tags: list[str] = field(default_factory=list)
    trackio_url: str | None = None
    wandb_url: str | None = None
    license: str | None = None
    language: str | list[str] | None = None

    def __post_init__(self):
        if self.trainer_kind not in TRAINER_KINDS:
            raise ValueError(f"trainer_kind={self.trainer_kind!r} is unknown; use one of {list(TRAINER_KINDS)}.")


def _format_value(value: Any) -> str:
    value = getattr(value, "value", value)  # enums (lr_scheduler_type, ...) by their value
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(v) for v in value)
    return str(value)


def _versions(is_adapter: bool) -> list[tuple[str, str]]:
    names = [("trl_async", "trl-async"), ("TRL", "trl"), ("Transformers", "transformers")]
    if is_adapter:
        names.append(("PEFT", "peft"))
    names += [("PyTorch", "torch"), ("Datasets", "datasets"), ("Tokenizers", "tokenizers")]
    out = []
    for label, dist in names:
        try:
            out.append((label, version(dist)))
        except PackageNotFoundError:
            if dist == "trl-async":
                from .. import __version__

                out.append((label, __version__))
    return out


def _card_tags(summary: CardSummary) -> list[str]:
    tags = ["trl", "trl-async", summary.trainer_kind]
    if summary.loss_type == "m2po":
        tags.append("m2po")
    if summary.peft_type == "LORA":
        tags.append("lora")
    tags.append("generated_from_trainer")
    for tag in summary.tags:  # the user's, the model's (`model.model_tags`) and the trackers'
        if tag not in tags:
            tags.append(tag)
    return tags


def build_model_card(summary: CardSummary):
    """The `huggingface_hub.ModelCard` of a run."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    eval_results = summary.eval_results
    model_index = None
    if eval_results is not None:
        model_index = [
            EvalResult(
                task_type="text-generation",
                task_name="Math word problems",
                dataset_type=eval_results["dataset"],
                dataset_name=eval_results["dataset"],
                dataset_split=eval_results.get("split"),
                metric_type="accuracy",
                metric_name="greedy accuracy (exact match)",
                metric_value=eval_results["after"]["accuracy"],
            )
        ]
    card_data = ModelCardData(
        base_model=summary.base_model,
        datasets=[summary.dataset_name] if summary.dataset_name else None,
        library_name="peft" if summary.is_adapter else "transformers",
        pipeline_tag="text-generation",
        model_name=summary.model_name,
        tags=_card_tags(summary),
        eval_results=model_index,
        license=summary.license,
        language=summary.language,
    )
    papers = []
    if summary.loss_type == "m2po":
        papers.append({"name": "M2PO", **M2PO_PAPER})
    if summary.trainer_kind == "grpo":
        from trl import GRPOTrainer

        papers.append({"name": "GRPO", **GRPOTrainer._paper})
    else:
        papers.append({"name": "PPO", **PPO_PAPER})
    method = {"grpo": "GRPO", "ppo": "PPO with a learned value function"}[summary.trainer_kind]
    if summary.async_generation:
        method = f"asynchronous {method}"
    if summary.loss_type == "m2po":
        loss_description = (
            "M2PO (Zheng et al. 2025, arXiv 2510.01161): the tokens with the largest squared log importance ratio "
            "against the behaviour policy are masked until the mean of that square over the kept tokens (the second "
            "moment) is within `m2po_threshold`; no ε-clip"
        )
    else:
        loss_description = f"TRL's `{summary.loss_type}`"
        if summary.async_generation and summary.max_staleness:
            loss_description += ", with TRL's truncated importance correction against the behaviour policy"
    config = [(key, _format_value(value)) for key, value in summary.config.items() if key != "reward_weights"]
    weights = summary.config.get("reward_weights")
    rewards = ", ".join(f"`{name}`" for name in summary.reward_functions) or "-"
    if weights:
        rewards += f" (weights {_format_value(weights)})"
    reward = reward_summary(summary.log_history)
    runtime = next((e["train_runtime"] for e in reversed(summary.log_history) if "train_runtime" in e), None)
    eval_view = None
    if eval_results is not None:
        eval_view = dict(eval_results)
        eval_view.setdefault("gain", eval_results["after"]["accuracy"] - eval_results["before"]["accuracy"])
    return ModelCard.from_template(
        card_data,
        template_str=CARD_TEMPLATE,
        model_name=summary.model_name,
        load_id=summary.load_id,
        base_model=summary.base_model,
        base_model_path=summary.base_model_path,
        dataset_name=summary.dataset_name,
        is_adapter=summary.is_adapter,
        method=method,
        trainer_class=summary.trainer_class,
        async_generation=summary.async_generation,
        max_staleness=summary.max_staleness,
        loss_description=loss_description,
        rewards=rewards,
        config=config,
        eval=eval_view,
        plot=summary.plot,
        steps=reward["steps"],
        global_step=summary.global_step,
        reward=reward,
        train_runtime=runtime,
        metrics=list(metric_summaries(summary.log_history).items()),
        versions=_versions(summary.is_adapter),
        papers=papers,
        trl_citation=TRL_CITATION,
        trackio_url=summary.trackio_url,
        wandb_url=summary.wandb_url,
        fmt=lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v),
        signed=lambda v: f"{v:+.4g}",
        interval=lambda ci: "-" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]",
    )


def _trainer_config(args, kind: str, model) -> dict[str, Any]:
    config: dict[str, Any] = {}
    missing = object()
    for name in (*COMMON_CONFIG_FIELDS, *KIND_CONFIG_FIELDS[kind]):
        if name in M2PO_ONLY_FIELDS and getattr(args, "loss_type", None) != "m2po":
            continue
        value = getattr(args, name, missing)
        if value is not missing and value is not None:
            config[name] = value
    if getattr(args, "reward_weights", None):
        config["reward_weights"] = list(args.reward_weights)
    peft_config = _peft_config(model)
    if peft_config is not None:
        for name in ("r", "lora_alpha", "lora_dropout", "target_modules"):
            value = getattr(peft_config, name, None)
            if value is not None:
                config[f"lora_{name}" if not name.startswith("lora_") else name] = (
                    sorted(value) if isinstance(value, (set, frozenset)) else value
                )
    return config


def _tool_config(trainer) -> dict[str, Any]:
    """With tools (or environments' tool methods): each tool as `name(arguments)`, and the tool settings."""
    tools = list(getattr(trainer, "tools", None) or [])
    if not tools:
        return {}
    from transformers.utils import get_json_schema

    def signature(tool) -> str:
        try:
            parameters = get_json_schema(tool)["function"]["parameters"].get("properties", {})
        except Exception:  # a tool without a docstring TRL could read: its name alone
            return tool.__name__
        return f"{tool.__name__}({', '.join(parameters)})"

    config: dict[str, Any] = {"tools": [signature(tool) for tool in tools]}
    iterations = getattr(trainer.args, "max_tool_calling_iterations", None)
    if iterations is not None:
        config["max_tool_calling_iterations"] = iterations
    for name in ("tool_timeout", "tool_call_threads"):
        if getattr(trainer.args, name, None) is not None:
            config[name] = getattr(trainer.args, name)
    return config


def _peft_config(model):
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping) or not peft_config:
        return None
    return peft_config.get(getattr(model, "active_adapter", "default")) or next(iter(peft_config.values()))


def _peft_type(peft_config) -> str | None:
    peft_type = getattr(peft_config, "peft_type", None)
    return None if peft_type is None else str(getattr(peft_type, "value", peft_type)).upper()


def summarize_trainer(
    trainer,
    trainer_kind: str,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: str | Sequence[str] | None = None,
    base_model: str | None = None,
    license: str | None = None,
    language: str | list[str] | None = None,
) -> CardSummary:
    """Gather a `CardSummary` from a trainer: its args, model, reward functions, log history and output_dir."""
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import get_callable_name, get_config_model_id, get_trackio_space_url

    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    is_adapter = is_peft_model(model)
    peft_config = _peft_config(model) if is_adapter else None
    if base_model is None:
        base = model.get_base_model() if is_adapter else model
        loaded_from = (getattr(peft_config, "base_model_name_or_path", None) if peft_config else None) or (
            get_config_model_id(base.config)
        )
    else:
        loaded_from = base_model
    hub_model_id = getattr(trainer, "hub_model_id", None) or args.hub_model_id
    if model_name is None:
        model_name = (
            hub_model_id.split("/")[-1] if hub_model_id else os.path.basename(os.path.abspath(args.output_dir))
        )
    eval_results = read_eval_results(args.output_dir)
    if dataset_name is None and eval_results is not None:
        dataset_name = (eval_results.get("train_dataset") or {}).get("hub_id")
    reward_funcs = getattr(trainer, "reward_funcs", None) or []
    reward_names = list(getattr(trainer, "reward_func_names", None) or [get_callable_name(f) for f in reward_funcs])
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    if hasattr(model.config, "unsloth_version"):
        tags.append("unsloth")
    if "JOB_ID" in os.environ:
        tags.append("hf_jobs")
    trackio_url = get_trackio_space_url()
    if trackio_url is not None:
        tags = [t for t in tags if not t.startswith("trackio:")] + [f"trackio:{trackio_url}"]
    wandb_url = None
    try:
        import wandb

        wandb_url = wandb.run.url if wandb.run is not None else None
    except ImportError:
        pass
    return CardSummary(
        trainer_kind=trainer_kind,
        trainer_class=type(trainer).__name__,
        model_name=model_name,
        hub_model_id=hub_model_id,
        load_id=hub_model_id or args.output_dir,
        base_model=loaded_from if looks_like_hub_id(loaded_from) else None,
        # a local folder: only its name (the card must not publish this machine's paths)
        base_model_path=None if looks_like_hub_id(loaded_from) else os.path.basename(os.path.normpath(loaded_from)),
        is_adapter=is_adapter,
        peft_type=_peft_type(peft_config),
        loss_type=getattr(args, "loss_type", "grpo"),
        async_generation=bool(getattr(args, "async_generation", False)),
        max_staleness=getattr(args, "max_staleness", None),
        reward_functions=reward_names,
        config={**_trainer_config(args, trainer_kind, model), **_tool_config(trainer)},
        log_history=list(trainer.state.log_history),
        global_step=trainer.state.global_step,
        eval_results=eval_results,
        dataset_name=dataset_name,
        plot=PLOT_FILE if os.path.isfile(os.path.join(args.output_dir, PLOT_FILE)) else None,
        tags=tags,
        trackio_url=trackio_url,
        wandb_url=wandb_url,
        license=license,
        language=language,
    )


def save_model_card(trainer, trainer_kind: str, **kwargs) -> str | None:
    """Write the card to `output_dir/README.md` (main process only); returns the path, or None on other ranks."""
    if not trainer.is_world_process_zero():
        return None
    card = build_model_card(summarize_trainer(trainer, trainer_kind, **kwargs))
    path = os.path.join(trainer.args.output_dir, "README.md")
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    card.save(path)
    return path


class ModelCardMixin:
    """Gives a trainer the trl_async model card: put it before TRL's trainer class in the bases, and set
    `model_card_kind` ("grpo" or "ppo").

    It replaces `create_model_card`, which `Trainer.push_to_hub` calls after saving the model (so the card overwrites
    the one PEFT's `save_pretrained` writes) and TRL calls at every checkpoint. Accepts TRL's arguments
    (`model_name`, `dataset_name`, `tags`) and those of transformers' version that make sense here (`dataset`,
    `finetuned_from`, `license`, `language`); transformers' `tasks`, `dataset_tags` and `dataset_args` are accepted
    and not shown. The accuracy section comes from `output_dir/eval.json` when present (the recipe writes it; a
    stale one left by an earlier run in the same output_dir would be reported too).
    """

    model_card_kind: str = "grpo"

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        *,
        dataset: str | list[str] | None = None,
        finetuned_from: str | None = None,
        license: str | None = None,
        language: str | list[str] | None = None,
        **unused,
    ) -> None:
        if dataset_name is None and dataset:
            dataset_name = dataset if isinstance(dataset, str) else dataset[0]
        save_model_card(
            self,
            self.model_card_kind,
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
            base_model=finetuned_from,
            license=license,
            language=language,
        )
