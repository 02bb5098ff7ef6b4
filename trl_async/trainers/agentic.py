"""The trainer's side of tools, environments and rollout functions (`rollout.agentic` is the generation process's).

The generation process ran TRL's multi-turn code (the tools, the environments' resets, the rollout function); the
trainer's hooks hand its results to TRL's scoring code as TRL's own `_generate` would (`engine.AsyncRolloutMixin`):
the `tool_mask` (TRL pads it, multiplies it into the loss mask, `num_items_in_batch` and its importance correction;
the trainers' statistics read it through `_loss_mask`) and the `extra_fields`, and TRL's `tools/*` metrics. What
TRL's scoring must not do for those rows is redo what the generation process did (`environments_left_to_the_rollouts`).
"""

from __future__ import annotations

import contextlib

import torch

from ..rollout.agentic import check_environment_names
from ..rollout.payload import RolloutPayload


@contextlib.contextmanager
def environments_left_to_the_rollouts(trainer):
    """For the length of TRL's `_generate_and_score_completions` on a rollout batch: TRL would draw an environment
    instance of the trainer's pool for every row and reset it with the row (its inline code, 2343-2392), but the
    rows' environments were drawn and reset in the generation process, and their prompts already carry the
    observations. So TRL sees no environment during the call (`environment_factories`, `environments`: None), as
    `_only_reward_functions` narrows the reward functions; its rows' rewards were scored where the instances live.
    Evaluation batches and `async_generation=False` use the trainer's environments as TRL does."""
    saved = trainer.environment_factories, trainer.environments
    trainer.environment_factories = trainer.environments = None
    try:
        yield
    finally:
        trainer.environment_factories, trainer.environments = saved


def log_tool_metrics(trainer, payload: RolloutPayload) -> None:
    """TRL's `tools/call_frequency` (tool calls per row) and `tools/failure_frequency` (failed calls per call) of a
    rollout batch, over every rank, as TRL's `_generate` logs them. Whenever the trainer has tools (a setting, the
    same on every rank), one gather per rollout batch on every rank, whatever the rank's batch holds."""
    if not trainer.tools:
        return
    counts = torch.tensor(
        [payload.tool_call_count, payload.tool_failure_count, payload.num_rows],
        dtype=torch.float64,
        device=trainer.accelerator.device,
    )
    calls, failures, rows = trainer.accelerator.gather(counts.unsqueeze(0)).sum(dim=0).tolist()
    metrics = trainer._metrics["train"]
    metrics["tools/call_frequency"].append(calls / rows)
    metrics["tools/failure_frequency"].append(failures / calls if calls > 0 else 0.0)


def check_environment_routing(trainer) -> None:
    """With a dict `environment_factory`, every row of a map-style dataset names one of its environments: checked
    before the generation process starts, with TRL's message (rows of a streamed dataset are checked as they are
    drawn, in the generation process)."""
    import datasets

    dataset = trainer.train_dataset
    factories = getattr(trainer, "environment_factories", None)
    if not getattr(trainer, "_multi_environment", False) or factories is None:
        return
    if isinstance(dataset, datasets.Dataset) and "environment" in dataset.column_names:
        check_environment_names(dataset["environment"], factories)


def model_token_counts(payload: RolloutPayload) -> list[int]:
    """Per row, the completion tokens the model sampled (TRL counts only those in its completion lengths)."""
    if payload.tool_mask is None:
        return [len(ids) for ids in payload.completion_ids]
    return [sum(mask) for mask in payload.tool_mask]


__all__ = [
    "check_environment_routing",
    "environments_left_to_the_rollouts",
    "log_tool_metrics",
    "model_token_counts",
]
