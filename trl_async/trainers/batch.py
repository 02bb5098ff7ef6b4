"""The fields a rollout batch adds to TRL's batch dict, declared.

TRL's `_generate_and_score_completions` returns a dict of tensors that TRL's buffering splits and shuffles into
micro-batches (`split_tensor_dict`, `shuffle_sequence_dict`): it must stay a dict of tensors to pass through TRL. In
an asynchronous training step every batch is a rollout batch, and every rollout batch carries all of
`RolloutFields`, whoever made it (the trainer at start-up, the generation process, a resumed stream) and whatever the
backend records. So whether a loss treats rows as rollouts is decided by the trainer's mode and config
(`AsyncRolloutMixin._async_training`), never by which keys a batch happens to hold; `rollout_view` reads the fields
and fails loudly if one is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..rollout.pipeline import RolloutBatch


class RolloutFields(TypedDict):
    """The rollout fields of a training batch, each (B, ...) with the batch's rows.

    * `rollout_versions` (B,) long: the weights version of each row, that of its oldest sampled token. A row's age
      (staleness) when it enters a loss is the trainer's version minus this.
    * `rollout_token_versions` (B, T) long: the weights version that sampled each completion token. With in-flight
      weight updates later tokens can be newer; otherwise every token has its row's version. Positions past a
      completion repeat its last token's version.
    * `sampling_per_token_logps` (B, T) float: μ, the log-probability of each sampled token under the distribution
      that sampled it (TRL's own field, set by TRL's scoring from what `_generate` returned)."""

    rollout_versions: Tensor
    rollout_token_versions: Tensor
    sampling_per_token_logps: Tensor


def rollout_fields(batch: RolloutBatch, completion_ids: Tensor) -> dict[str, Tensor]:
    """The version fields of `RolloutFields` for `batch`, shaped like TRL's padded `completion_ids` (B, T)."""
    rows, width = completion_ids.shape
    device = completion_ids.device
    versions = torch.full((rows,), batch.version, dtype=torch.long, device=device)
    per_token = batch.payload.token_versions
    if per_token is None:  # the backend records no per-token versions: every token has its row's version
        token_versions = versions.unsqueeze(1).expand(rows, width).clone()
    else:
        token_versions = _padded(per_token, rows, width, fill=batch.version).to(device)
    return {"rollout_versions": versions, "rollout_token_versions": token_versions}


def rollout_view(inputs: dict) -> RolloutFields:
    """The rollout fields of a training batch (one of `_compute_loss`'s micro-batches). Raises if one is missing:
    in an asynchronous training step that is a bug, and guessing would let the ranks disagree."""
    missing = [name for name in RolloutFields.__annotations__ if inputs.get(name) is None]
    if missing:
        raise KeyError(
            f"The batch of an asynchronous training step lacks {', '.join(missing)}: every rollout batch carries "
            "them (trl_async.trainers.batch). TRL's scoring may have changed what it keeps (trl_contract)."
        )
    return RolloutFields(**{name: inputs[name] for name in RolloutFields.__annotations__})


def _padded(rows: list[list[int]], num_rows: int, width: int, fill: int) -> Tensor:
    """Ragged per-row lists as (num_rows, width), each row padded with its last value (`fill` for an empty row)."""
    out = torch.full((num_rows, width), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            row = row[:width]
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            out[i, len(row) :] = row[-1]
    return out


__all__ = ["RolloutFields", "rollout_fields", "rollout_view"]
