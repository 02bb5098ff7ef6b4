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
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

SUM, MIN, MAX = "sum", "min", "max"
_EMPTY = {SUM: 0.0, MIN: float("inf"), MAX: float("-inf")}


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


class WindowStatistics:
    """One mode's figures of the current logging window on this rank (see the module docstring)."""

    def __init__(self, layout: StatisticsLayout, device):
        self.layout, self.device = layout, device
        self.values = layout.empty(device)  # this rank's window
        self.pending: Tensor | None = None  # every rank's windows, reduced and not yet taken (same layout)

    def add(self, name: str, value: Tensor | float | Iterable[float]) -> None:
        """Combine `value` (the field's size) into the window by the field's reduction. No host sync."""
        field, where = self.layout.fields[name], self.layout.slices[name]
        value = torch.as_tensor(value, dtype=torch.float64).to(self.device).detach().reshape(-1)
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


__all__ = ["MAX", "MIN", "SUM", "Field", "StatisticsLayout", "WindowStatistics"]
