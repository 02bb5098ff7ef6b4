"""`FormatReward`: required token sequences present, in order, before the first EOS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._tokens import SuffixTable, anchored_variants, default_eos_ids, normalize_eos
from .base import TensorReward, as_int_tuple, check_tokenizer_argument, to_device, valid_token_mask

__all__ = ["FormatReward"]


class FormatReward(TensorReward):
    """1.0 when every required item occurs before the first EOS, in the given order and without overlapping,
    else 0.0.

    Args:
        tokenizer: used at construction only, to turn string items into their token spellings in context (a tag
            may merge with its neighbours: `.</` + `think>`). May be `None` when every item is given as token ids.
        required: the items, in order. Each is a string (needs `tokenizer`), a sequence of token ids, or a list of
            alternative token-id sequences. Trailing whitespace of a string item is not required (`"#### "` is
            satisfied by `####` followed by ` -5`, which the tokenizer spells `####`, ` -`, `5`).
        eos_token_id: id(s) that end the completion; default: the tokenizer's eos/pad and end-of-turn ids (no EOS
            when there is no tokenizer).
        name: logged name (default `"format_reward"`).

    Items are located greedily (the earliest-ending occurrence of item 1, then of item 2 starting after it, ...),
    which finds an in-order placement whenever one exists. One vectorized pass per item; no loop over rows.
    """

    _device_caches = ("_eos_cache",)

    def __init__(
        self,
        tokenizer: Any = None,
        required: Sequence[Any] = ("<think>", "</think>", "#### "),
        *,
        eos_token_id: int | Sequence[int] | None = None,
        name: str | None = None,
    ):
        super().__init__(name=name)
        check_tokenizer_argument(tokenizer, "FormatReward", optional=True)
        if isinstance(required, str):
            required = (required,)
        if not required:
            raise ValueError("FormatReward needs at least one required item")
        variants: list[tuple[tuple[int, ...], int]] = []
        for item_index, item in enumerate(required):
            for seq in self._item_variants(tokenizer, item, item_index):
                variants.append((seq, item_index))
        self.required = tuple(required)
        self.n_items = len(required)
        self._table = SuffixTable(variants, self.n_items)
        if eos_token_id is None and tokenizer is not None:
            self.eos_token_ids = default_eos_ids(tokenizer)
        else:
            self.eos_token_ids = normalize_eos(eos_token_id)
        self._eos_cache: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def _item_variants(tokenizer: Any, item: Any, index: int) -> list[tuple[int, ...]]:
        what = f"FormatReward required item {index}"
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(f"{what} is a string ({item!r}): pass a tokenizer, or give token ids")
            if not item.strip():
                raise ValueError(f"{what} is empty or whitespace")
            return sorted({toks for toks, _, _ in anchored_variants(tokenizer, item)})
        item = list(item.tolist() if isinstance(item, torch.Tensor) else item)
        if item and all(isinstance(x, (list, tuple, torch.Tensor)) for x in item):
            return [as_int_tuple(x, f"{what} (alternative {j})") for j, x in enumerate(item)]
        return [as_int_tuple(item, what)]

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        device = completion_ids.device
        if completion_ids.shape[1] == 0:
            return torch.zeros(completion_ids.shape[0], dtype=torch.float32, device=device)
        eos = self._eos_cache.get(device)
        if eos is None:
            eos = self._eos_cache[device] = to_device(torch.tensor(self.eos_token_ids, dtype=torch.long), device)
        valid = valid_token_mask(completion_ids, completion_mask, eos)
        lengths = self._table.lookup(completion_ids, valid)  # (B, L, n_items)
        length = completion_ids.shape[1]
        positions = torch.arange(length, device=device)
        never = length  # "not found" end position
        prev_end = torch.full((completion_ids.shape[0], 1), -1, dtype=torch.long, device=device)
        for item in range(self.n_items):
            k = lengths[:, :, item]
            start = positions - k + 1  # start of the shortest variant ending at each position
            ok = (k > 0) & (start > prev_end)
            prev_end = torch.where(ok, positions, never).amin(1, keepdim=True)
        return (prev_end[:, 0] < never).to(torch.float32)
