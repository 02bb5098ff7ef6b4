"""The trainers' own statistics of a logging window: recorded on each rank without communication, reduced over the
ranks once per log.

**Why one reduction.** The figures the trainers add to TRL's (`async/*`, `offpolicy/*`, `m2po/*`, `ppo/*`, the
importance-weight figures) used to be reduced over the ranks where they were computed, one collective each, several
of them only for some batches. Two ranks whose batches differed (one made by the trainer at start-up, one from its
generation process) then ran different collectives and the run crashed (gloo: "Received data size doesn't match
expected size"). Here each rank adds its figures to a vector whose layout is fixed when the trainer is built, from
its config alone (`StatisticsLayout`), and `reduce` all-gathers that vector once per logging step, on every rank, in
every mode: a rank's data changes what it contributes, never whether or with what shape it joins
(docs/architecture.md, "Several processes").

**Where the reduction runs.** Not in `log`: users call `trainer.log(...)` on the main process only (it has no
collective in TRL or transformers), and a collective there would hang the other ranks. The trainers reduce at points
every rank passes: the end of an optimizer step at which Trainer will log (or stop), and the end of an evaluation loop.
`log` then only takes the totals (`take`), on whichever rank calls it.

Each field says how it combines over the window and over the ranks: `sum` (counts and sums, from which means and
fractions are taken when logged, so that they are token- or row-weighted over the whole window), `min` or `max`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from ..algorithms.m2po import M2PO_SUM_KEYS, m2po_metrics
from ..algorithms.offpolicy import OFFPOLICY_SUM_KEYS, offpolicy_metrics
from ..rollout.pipeline import ASYNC_WINDOW_KEYS
from .correction import WEIGHT_SUMS

SUM, MIN, MAX = "sum", "min", "max"
_EMPTY = {SUM: 0.0, MIN: float("inf"), MAX: float("-inf")}

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    size: int = 1
    reduction: str = SUM

    def __post_init__(self):
        if self.reduction not in _EMPTY:
            raise ValueError(f"unknown reduction {self.reduction!r} for statistic {self.name!r}")


class StatisticsLayout:
    """The fields of the statistics vector, in order. Built from the config only, so every rank has the same."""

    def __init__(self, fields: Iterable[Field]):
        self.fields: dict[str, Field] = {}
        self.slices: dict[str, slice] = {}
        offset = 0
        for field in fields:
            if field.name in self.fields:
                raise ValueError(f"statistic {field.name!r} declared twice")
            self.fields[field.name] = field
            self.slices[field.name] = slice(offset, offset + field.size)
            offset += field.size
        self.size = offset

    def empty(self, device) -> Tensor:
        values = torch.empty(self.size, dtype=torch.float64, device=device)
        for name, field in self.fields.items():
            values[self.slices[name]] = _EMPTY[field.reduction]
        return values


def _to_device(value: Tensor | float | Iterable[float], device) -> Tensor:
    """`value` as float64 on `device`. Host numbers go through pinned memory on a GPU: a copy from pageable memory
    would wait for the device's queue (a host sync)."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    host = torch.tensor(value, dtype=torch.float64)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class WindowStatistics:
    """One mode's figures of the current logging window on this rank (see the module docstring)."""

    def __init__(self, layout: StatisticsLayout, device):
        self.layout, self.device = layout, device
        self.values = layout.empty(device)  # this rank's window
        self.pending: Tensor | None = None  # every rank's windows, reduced and not yet taken (same layout)

    def add(self, name: str, value: Tensor | float | Iterable[float]) -> None:
        """Combine `value` (the field's size) into the window by the field's reduction. No host sync: a tensor is
        combined where it is, host numbers are copied to the device without waiting (`_to_device`)."""
        field, where = self.layout.fields[name], self.layout.slices[name]
        value = _to_device(value, self.device).reshape(-1)
        if value.numel() != field.size:
            raise ValueError(f"statistic {name!r} has {field.size} values, got {value.numel()}")
        current = self.values[where]
        if field.reduction == SUM:
            self.values[where] = current + value
        elif field.reduction == MIN:
            self.values[where] = torch.minimum(current, value)
        else:
            self.values[where] = torch.maximum(current, value)

    def local(self, name: str) -> Tensor:
        """This rank's value of a field so far in the window (for tests and warnings)."""
        return self.values[self.layout.slices[name]].cpu()

    def reduce(self, gather: Callable[[Tensor], Tensor]) -> None:
        """Combine every rank's window (one `gather` of a (1, size) float64 tensor) into the totals `take` returns, and
        start the window afresh. To call on every rank at the same point (a collective); totals not taken yet are
        combined with the new ones."""
        ranks = gather(self.values.unsqueeze(0)).reshape(-1, self.layout.size).to(self.device)
        self.values = self.layout.empty(self.device)
        previous = self.layout.empty(self.device) if self.pending is None else self.pending
        combined = torch.empty_like(previous)
        for name, field in self.layout.fields.items():
            where = self.layout.slices[name]
            part = torch.cat([ranks[:, where], previous[where].unsqueeze(0)])
            if field.reduction == SUM:
                combined[where] = part.sum(dim=0)
            elif field.reduction == MIN:
                combined[where] = part.min(dim=0).values
            else:
                combined[where] = part.max(dim=0).values
        self.pending = combined

    def take(self) -> dict[str, Tensor] | None:
        """The totals over every rank of the windows reduced since the last `take`, as CPU tensors by field name, or
        None when nothing was reduced. No communication: a rank may call it alone (a `log` on the main process)."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending.cpu(), None
        return {name: pending[self.layout.slices[name]] for name in self.layout.fields}


# ---------------------------------------------------------------------------------------------- the trainers' figures
# This rank's sums of the completions of a logging window (`record_completions`).
COMPLETION_SUMS = ("rows", "length_sum", "terminated_rows", "terminated_length_sum")
TOKEN_MEANS = ("entropy", "kl")  # per-token figures of M2PO's loss, token-weighted (`token_mean/<name>`)


def trainer_fields(max_age: int) -> list[Field]:
    """What both trainers record: the rollout pipeline's window (`async/*`), the correction against μ (`offpolicy/*`,
    the importance-weight figures), row and token ages (`max_age` = max_staleness: ages 0..max_age and "older"), M2PO's
    sums, per-token means and the completions of rows TRL's `_generate` did not see."""
    return [
        Field("async", len(ASYNC_WINDOW_KEYS)),
        Field("async_staleness_max", 1, MAX),
        Field("offpolicy", len(OFFPOLICY_SUM_KEYS)),
        Field("offpolicy_ess", 2),  # Σ ESS of the window's batches, the number of batches
        Field("offpolicy_ess_min", 1, MIN),
        Field("row_ages", max_age + 2),
        Field("token_ages", 2),  # Σ age over valid completion tokens, their count
        Field("m2po", len(M2PO_SUM_KEYS)),
        Field("importance_weights", len(WEIGHT_SUMS)),
        Field("importance_weights_min", 1, MIN),
        Field("importance_weights_max", 1, MAX),
        *(Field(f"token_mean/{name}", 2) for name in TOKEN_MEANS),
        Field("completions", len(COMPLETION_SUMS)),
        Field("completions_min", 2, MIN),  # shortest completion, shortest terminated one
        Field("completions_max", 2, MAX),
    ]


def record_async_window(statistics: WindowStatistics, window: dict) -> None:
    """`RolloutPipeline.window_metrics()` of this rank into the window."""
    statistics.add("async", [float(window[key]) for key in ASYNC_WINDOW_KEYS])
    statistics.add("async_staleness_max", float(window["staleness_max"]))


def record_completions(
    statistics: WindowStatistics,
    completion_ids: Sequence[Sequence[int]],
    eos_and_pad: set,
    lengths: Sequence[int] | None = None,
) -> None:
    """The lengths of a batch's completions (a completion that ends in EOS or padding terminated; one cut at the length
    limit did not), as `COMPLETION_SUMS` and extremes. `lengths`: the tokens to count per completion (TRL counts only
    the model's where a tool mask exists), default all of them."""
    lengths = [len(c) for c in completion_ids] if lengths is None else list(lengths)
    terminated = [n for n, c in zip(lengths, completion_ids, strict=True) if c and c[-1] in eos_and_pad]
    inf = float("inf")
    statistics.add("completions", [len(lengths), sum(lengths), len(terminated), sum(terminated)])
    statistics.add("completions_min", [min(lengths, default=inf), min(terminated, default=inf)])
    statistics.add("completions_max", [max(lengths, default=-inf), max(terminated, default=-inf)])


def trainer_metrics(totals: dict[str, Tensor], num_ranks: int) -> dict[str, float]:
    """The logged metrics of a window from its totals over every rank (`WindowStatistics.reduce`): each figure is a
    ratio of window totals (token-, row- or batch-weighted) or an extreme; a figure with nothing to measure in the
    window is left out."""
    out = _async_metrics(dict(zip(ASYNC_WINDOW_KEYS, totals["async"].tolist(), strict=True)),
                         float(totals["async_staleness_max"]), num_ranks)  # fmt: skip
    ess_sum, ess_count = totals["offpolicy_ess"].tolist()
    out.update(
        offpolicy_metrics(
            totals["offpolicy"],
            ess_sum,
            ess_count,
            float(totals["offpolicy_ess_min"]),
            totals["row_ages"],
            totals["token_ages"],
        )  # fmt: skip
    )
    m2po = totals["m2po"]
    if m2po[M2PO_SUM_KEYS.index("valid_tokens")] > 0 or m2po[-1] > 0:
        out.update({f"m2po/{key}": value for key, value in m2po_metrics(m2po).items()})
    weights = dict(zip(WEIGHT_SUMS, totals["importance_weights"].tolist(), strict=True))
    if weights["count"]:
        prefix, count = "sampling/importance_sampling_ratio", weights["count"]
        out[f"{prefix}/mean"] = weights["weight_sum"] / count
        out[f"{prefix}/min"] = float(totals["importance_weights_min"])
        out[f"{prefix}/max"] = float(totals["importance_weights_max"])
        out[f"{prefix}/masked_fraction"] = weights["zero"] / count
        out[f"{prefix}/clipped_fraction"] = weights["changed"] / count
    for name in TOKEN_MEANS:
        total, tokens = totals[f"token_mean/{name}"].tolist()
        if tokens:
            out[name] = total / tokens
    out.update(_completion_metrics(totals))
    return out


def warn_of_m2po_masked_micro_batches(totals: dict[str, Tensor], threshold) -> None:
    """The window's micro-batches (every rank) in which M2PO kept no token: warned about once per log, from the
    totals (reading the flag per micro-batch would be a host sync each)."""
    all_masked = int(totals["m2po"][-1])
    if all_masked:
        logger.warning(
            "M2PO masked every token of %d micro-batch(es) in this logging window (their smallest δ² exceeds "
            "m2po_threshold=%s): they contribute no gradient. Frequent occurrences mean the rollouts are far "
            "off-policy; lower max_staleness.", all_masked, threshold,
        )  # fmt: skip


def _async_metrics(total: dict[str, float], staleness_max: float, num_ranks: int) -> dict[str, float]:
    if not total["batches"] and not total["evicted_rows"]:
        return {}  # nothing was trained on since the last log (e.g. the summary logged when training ends)
    out = {}
    rows, batches = total["rows"], max(total["batches"], 1.0)
    if total["batches"]:
        out["async/staleness_mean"] = total["staleness_row_sum"] / max(rows, 1.0)
        out["async/staleness_max"] = staleness_max
        out["async/generate_s"] = total["generate_s"] / batches
        out["async/reward_s"] = total["reward_s"] / batches
        if total["tool_s"]:  # tools and environments (`rollout.agentic`): seconds in their calls per batch
            out["async/tool_s"] = total["tool_s"] / batches
        # Rows of the backend call that sampled each batch, batch-weighted (several batches share a decode).
        out["async/rows_per_decode"] = total["decode_rows_sum"] / batches
    if total["decode_fallbacks"]:  # CUDA-graph decoding failed to compile and fell back to eager decoding
        out["async/cuda_graphs_fallbacks"] = total["decode_fallbacks"]
    out["async/evicted"] = total["evicted_rows"]
    out["async/evicted_fraction"] = total["evicted_rows"] / max(total["evicted_rows"] + rows, 1.0)
    out["async/queue_size"] = total["queue_size"] / num_ranks
    out["async/generator_wait_s"] = total["generator_wait_s"] / num_ranks
    out["async/trainer_wait_s"] = total["trainer_wait_s"] / num_ranks
    out["async/trainer_generated_batches"] = total["trainer_batches"] / num_ranks
    if total["lending_calls"]:  # CPU core lending (rollout/cores.py): share of layer passes on every core
        out["async/trainer_lent_cores_fraction"] = total["lent_calls"] / total["lending_calls"]
    return out


def _completion_metrics(totals: dict[str, Tensor]) -> dict[str, float]:
    """TRL's `completions/*` (its `_generate`'s), over the window."""
    rows, length_sum, terminated, terminated_sum = totals["completions"].tolist()
    if not rows:
        return {}
    (shortest, shortest_terminated), (longest, longest_terminated) = (
        totals["completions_min"].tolist(),
        totals["completions_max"].tolist(),
    )
    return {
        "completions/mean_length": length_sum / rows,
        "completions/min_length": shortest,
        "completions/max_length": longest,
        "completions/clipped_ratio": (rows - terminated) / rows,
        # TRL's convention: 0 when no completion of the window terminated.
        "completions/mean_terminated_length": terminated_sum / terminated if terminated else 0.0,
        "completions/min_terminated_length": shortest_terminated if terminated else 0.0,
        "completions/max_terminated_length": longest_terminated if terminated else 0.0,
    }


__all__ = [
    "COMPLETION_SUMS",
    "MAX",
    "MIN",
    "SUM",
    "Field",
    "StatisticsLayout",
    "WindowStatistics",
    "record_async_window",
    "record_completions",
    "trainer_fields",
    "trainer_metrics",
]
