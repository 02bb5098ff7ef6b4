"""`LengthPenalty`: DAPO's soft overlong punishment, from `completion_mask` only."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .base import TensorReward

__all__ = ["LengthPenalty"]


class LengthPenalty(TensorReward):
    r"""Soft overlong punishment (DAPO, Eq. 13; https://huggingface.co/papers/2503.14476), tensor-native.

    With `n = completion_mask.sum(1)` (TRL's mask counts the EOS token, as TRL's own reward counts
    `len(completion_ids)`), `L_max = max_length` and `L_cache = cache_length`:

    $$ R(n) = \begin{cases} 0 & n \le L_{max} - L_{cache} \\
                           \frac{(L_{max} - L_{cache}) - n}{L_{cache}} & L_{max} - L_{cache} < n \le L_{max} \\
                           -1 & n > L_{max} \end{cases} $$

    times `penalty`. With `cache_length=0` it is a hard `-penalty` above `max_length`. Same values as
    `trl.rewards.get_soft_overlong_punishment(max_length, cache_length)` (tested), but computed on the device.
    Set `max_length` to `max_completion_length` and `cache_length` to the soft zone (DAPO: 4096 of 20480).
    """

    def __init__(self, max_length: int, cache_length: int = 0, *, penalty: float = 1.0, name: str | None = None):
        super().__init__(name=name)
        for setting, value in (("max_length", max_length), ("cache_length", cache_length)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"LengthPenalty {setting} must be an int (a number of completion tokens), got {value!r} "
                    f"({type(value).__name__}); e.g. LengthPenalty(max_length=args.max_completion_length)."
                )
        if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real):
            raise TypeError(f"LengthPenalty penalty must be a number, got {penalty!r} ({type(penalty).__name__}).")
        if max_length <= 0:
            raise ValueError(
                f"LengthPenalty max_length must be positive, got {max_length}; set it to max_completion_length."
            )
        if not 0 <= cache_length <= max_length:
            raise ValueError(
                f"LengthPenalty cache_length must be in [0, max_length={max_length}], got {cache_length}: it is the "
                "soft zone before max_length (DAPO: 4096 of 20480)."
            )
        self.max_length, self.cache_length, self.penalty = int(max_length), int(cache_length), float(penalty)

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        n = completion_mask.to(torch.float32).sum(1)
        soft_start = self.max_length - self.cache_length
        if self.cache_length > 0:
            soft = (soft_start - n) / self.cache_length
        else:
            soft = torch.zeros_like(n)
        r = torch.where(n <= soft_start, torch.zeros_like(n), torch.where(n <= self.max_length, soft, -1.0))
        return r * self.penalty
