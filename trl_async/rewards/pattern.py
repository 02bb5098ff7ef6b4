"""`TokenPatternReward`: does a token sequence occur before the first EOS? Vectorized over the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._tokens import normalize_eos
from .base import TensorReward, as_int_tuple, to_device, valid_token_mask

__all__ = ["TokenPatternReward", "pattern_occurs"]

_PATTERN_PAD = -2  # pattern padding: equal to no token (ids are >= 0, invalid positions are -1)


def pattern_occurs(ids: torch.Tensor, valid: torch.Tensor, patterns: torch.Tensor, lengths: torch.Tensor):
    """`(B,)` bool: row b's pattern occurs entirely inside its valid positions.

    `ids`, `valid`: `(B, L)`. `patterns`: `(B, K)` or `(1, K)` LongTensor, each row's pattern left-aligned and padded
    with `-2`; `lengths`: `(B,)` or `(1,)` pattern lengths (>= 1). Windows are `unfold` views over the ids padded by
    `K-1` on the right, so a window starts at every position; a padded pattern slot never equals a token, so "all
    real slots match" is "the number of equal slots == the pattern length". Invalid positions are replaced by -1
    first, so a window that touches padding or anything from the first EOS on cannot match.
    """
    k = patterns.shape[1]
    if ids.shape[1] == 0:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    ids = torch.where(valid, ids, -1)
    windows = F.pad(ids, (0, k - 1), value=-1).unfold(1, k, 1)  # (B, L, K) view
    hits = (windows == patterns.unsqueeze(1)).sum(-1) == lengths.unsqueeze(1)  # (B, L)
    return hits.any(1)


class TokenPatternReward(TensorReward):
    """1.0 if the row's target token sequence occurs before the row's first EOS (and inside `completion_mask`),
    else 0.0.

    Args:
        pattern: a fixed target, a non-empty sequence of token ids.
        eos_token_id: an id or ids that end a completion (`None`: only `completion_mask` limits the search).
        pattern_column: instead of `pattern`, a dataset column whose value per row is that row's target (a non-empty
            list of token ids; rows may have different lengths: they are padded to a common K).
        name: logged name (default `"token_pattern_reward"`).

    Raises `ValueError` for an empty pattern (at construction for `pattern`, at scoring time for a column value).
    """

    _device_caches = ("_device_cache",)

    def __init__(
        self,
        pattern: Sequence[int] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pattern_column: str | None = None,
        *,
        name: str | None = None,
    ):
        super().__init__(name=name)
        if (pattern is None) == (pattern_column is None):
            raise ValueError("TokenPatternReward needs exactly one of `pattern` and `pattern_column`")
        self.pattern = None if pattern is None else as_int_tuple(pattern, "TokenPatternReward pattern")
        self.pattern_column = pattern_column
        self.eos_token_ids = normalize_eos(eos_token_id)
        self._device_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        consts = self._device_cache.get(device)
        if consts is None:
            eos = to_device(torch.tensor(self.eos_token_ids, dtype=torch.long), device)
            if self.pattern is not None:
                pattern = to_device(torch.tensor([self.pattern], dtype=torch.long), device)
                length = to_device(torch.tensor([len(self.pattern)], dtype=torch.long), device)
                consts = (eos, pattern, length)
            else:
                consts = (eos,)
            self._device_cache[device] = consts
        return consts

    def _row_patterns(self, values: Sequence[Any], batch: int, device: torch.device):
        if len(values) != batch:
            raise ValueError(f"{self.__name__}: {len(values)} patterns in {self.pattern_column!r} for {batch} rows")
        rows = [
            as_int_tuple(v, f"{self.__name__}: pattern of row {i} ({self.pattern_column!r})")
            for i, v in enumerate(values)
        ]
        k = max(len(r) for r in rows)
        padded = torch.tensor([r + (_PATTERN_PAD,) * (k - len(r)) for r in rows], dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        return to_device(padded, device), to_device(lengths, device)

    @property
    def required_columns(self) -> tuple[str, ...]:
        return () if self.pattern_column is None else (self.pattern_column,)

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        device = completion_ids.device
        consts = self._constants(device)
        if self.pattern is not None:
            patterns, lengths = consts[1], consts[2]
        else:
            if self.pattern_column not in columns:
                raise KeyError(f"{self.__name__} needs the dataset column {self.pattern_column!r}")
            patterns, lengths = self._row_patterns(columns[self.pattern_column], completion_ids.shape[0], device)
        valid = valid_token_mask(completion_ids, completion_mask, consts[0])
        return pattern_occurs(completion_ids, valid, patterns, lengths).to(torch.float32)
