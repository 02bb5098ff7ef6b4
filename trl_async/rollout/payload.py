"""What crosses the process boundary: one generation batch, as the generation process made it.

The generation process (or the trainer itself, while the generation process starts) builds a `RolloutPayload` per
generation batch; the queue pickles it into a spool file; the trainer's overrides of TRL's `_generate` and
`_calculate_rewards` hand its fields to TRL's own scoring code. Plain Python lists and CPU tensors only, so that it
pickles the same wherever it was made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class RolloutPayload:
    rows: list[dict]  # the dataset rows of the batch (prompt and every column), in TRL's sampler order
    stream_index: int  # position of the batch in this rank's prompt stream (its sampling seed derives from it)
    prompt_ids: list[list[int]]  # tokenized prompts, one per row, without padding
    completion_ids: list[list[int]]  # sampled completions, cut after the first EOS
    logprobs: list[list[float]]  # behaviour log-probs μ per completion token, in the trainer's parametrization
    rewards_per_func: torch.Tensor  # (rows, reward functions) float32; NaN where a function returned None or did not
    # run here (reward models are scored by the trainer)
    completions: list | None  # decoded completions (text or messages), or None when nothing needed them decoded
    extra_logs: dict[str, list]  # reward functions' `log_extra` calls, by column
    logged_metrics: dict[str, list[float]]  # reward functions' `log_metric` calls, by name
    generate_s: float  # seconds spent tokenizing and sampling
    reward_s: float  # seconds spent scoring (and decoding)
    # Per completion token, the weights version that sampled it (in-flight weight updates change it mid-sequence);
    # the batch's oldest token defines its version and staleness. None where the backend does not record it.
    token_versions: list[list[int]] | None = None
    # Tools, environments, `rollout_func` (`rollout.agentic`; the defaults for other runs). Per completion token, 1 for
    # a token the model sampled, 0 for a tool's or environment's tokens (TRL's `tool_mask`; μ is 0.0 there, as TRL
    # writes it); None in runs without them. Every batch of an agentic run carries one, all ones where no tool ran.
    tool_mask: list[list[int]] | None = None
    tool_call_count: int = 0  # TRL's batch totals of `_tool_call_loop`: tool calls, and those that failed
    tool_failure_count: int = 0
    # A `rollout_func`'s keys besides TRL's required three (and `env_mask`, which became `tool_mask`): merged into the
    # rows for the reward functions, as TRL merges them.
    extra_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_s: float = 0.0  # seconds spent in tool calls and environment calls (factory, reset); not in `generate_s`
    decode_rows: int = 0  # rows of the backend call that sampled this batch (several batches share a decode)
    # Decodes of the generation process, so far, that fell back to eager decoding after a failed CUDA-graph compile.
    decode_fallbacks: int = 0

    @property
    def oldest_version(self) -> int | None:
        """The version of the oldest sampled token, or None without per-token versions (or tokens)."""
        firsts = [versions[0] for versions in self.token_versions or [] if versions]
        return min(firsts) if firsts else None

    @property
    def num_rows(self) -> int:
        return len(self.rows)
