"""One forward per prompt group: a GRPO batch's completions share their prompt, so compute it once.

GRPO samples `num_generations` completions per prompt, and TRL's training forward runs every row as
`[prompt, completion]`, computing each prompt `num_generations` times. With prompts of P tokens, completions padded to
L and G rows a group, the forward costs G·(P+L) tokens a group; packed, it costs (P−1) + G·(1+L):

    [ prompt[:-1] | prompt[-1], c_1 | prompt[-1], c_2 | ... | prompt[-1], c_G ]

Each row segment repeats the prompt's last token (its hidden state is the one that predicts the completion's first
token, and each position predicts one label), attends to the shared prompt and causally to itself, never to another
segment, and keeps the positions it has in the unpacked row (the prompt's position ids, then P−1, P, ..., P+L−1), so
every completion token sees exactly the keys, values and positions it sees in TRL's forward: the log-probabilities
are the same function of the weights (equal up to float summation order, `tests/test_shared_prompt.py`), and so are
their gradients (the shared prompt's activations receive the gradient of all G rows, as the sum of the G copies
would). What this needs from the model: a dense 4-D attention mask (transformers' `sdpa` and `eager` attention take
one as given) and position ids as an argument. The attention itself gets dearer (one (S, S) mask per group instead of
G (P+L)² ones), which is why `pack_prompt_groups` declines when packing saves too few tokens.

Pure tensor code, no model: `pack_prompt_groups` builds the packed batch, `PackedRows.unpack` maps per-position
outputs back to TRL's (B, L) layout.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PackedRows:
    input_ids: torch.Tensor  # (N, S) N prompt groups, packed
    position_ids: torch.Tensor  # (N, S) the positions each token has in its unpacked row
    allowed: torch.Tensor  # (N, S, S) bool: query s may attend to key t
    labels: torch.Tensor  # (N, S) completion tokens where they are predicted from, -100 elsewhere
    row_group: torch.Tensor  # (B,) which packed sequence holds row b
    row_start: torch.Tensor  # (B,) where row b's predicted tokens start in the shifted outputs (see `unpack`)
    completion_length: int  # L

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The 4-D mask transformers takes as given: boolean for `sdpa`, additive for `eager`."""
        mask = self.allowed.unsqueeze(1)
        if attn_implementation == "sdpa":
            return mask
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.finfo(dtype).min)

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """(N, S−1) outputs of a forward with `labels` (position s−1 scores the label at s, as TRL's fused head returns
        them) → (B, L) in TRL's row order, the completion tokens' values."""
        offsets = torch.arange(self.completion_length, device=per_position.device)
        columns = self.row_start.to(per_position.device).unsqueeze(1) + offsets
        return per_position[self.row_group.to(per_position.device).unsqueeze(1), columns]


def pack_prompt_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    min_saving: float = 0.2,
) -> PackedRows | None:
    """Pack rows `[prompt, completion]` (left-padded prompts, right-padded completions: TRL's layout) whose prompts are
    identical (same tokens, same padding) into one sequence per prompt; None if that saves less than `min_saving` of
    the tokens (e.g. every prompt distinct), or if a prompt is shorter than one token."""
    num_rows, width = input_ids.shape
    L = logits_to_keep
    P = width - L
    if P < 1 or num_rows < 2:
        return None
    prompts = torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], dim=1)
    _, group_of_row = torch.unique(prompts, dim=0, return_inverse=True)
    num_groups = int(group_of_row.max()) + 1
    sizes = torch.bincount(group_of_row, minlength=num_groups)
    max_size = int(sizes.max())
    length = (P - 1) + max_size * (1 + L)
    if num_groups * length > (1 - min_saving) * num_rows * width:
        return None
    device = input_ids.device
    # The slot of each row inside its group (0..size-1), in row order.
    order = torch.argsort(group_of_row * num_rows + torch.arange(num_rows, device=device))
    slot = torch.empty_like(group_of_row)
    first_of_group = torch.cumsum(sizes, 0) - sizes
    slot[order] = torch.arange(num_rows, device=device) - first_of_group[group_of_row[order]]

    # The packed tokens. Segment k occupies [P-1 + k(1+L), P-1 + (k+1)(1+L)): the prompt's last token, then L tokens.
    first_row = torch.zeros(num_groups, dtype=torch.long, device=device)
    first_row[group_of_row.flip(0)] = torch.arange(num_rows - 1, -1, -1, device=device)  # any row of the group
    packed = torch.zeros((num_groups, length), dtype=input_ids.dtype, device=device)
    valid = torch.zeros((num_groups, length), dtype=torch.bool, device=device)
    segment = torch.full((num_groups, length), -1, dtype=torch.long, device=device)  # -1: the shared prompt
    positions = torch.zeros((num_groups, length), dtype=torch.long, device=device)
    labels = torch.full((num_groups, length), -100, dtype=torch.long, device=device)
    packed[:, : P - 1] = input_ids[first_row, : P - 1]
    valid[:, : P - 1] = attention_mask[first_row, : P - 1].bool()
    positions[:, : P - 1] = torch.arange(P - 1, device=device)
    starts = (P - 1) + slot * (1 + L)  # (B,) start of each row's segment
    columns = starts.unsqueeze(1) + torch.arange(1 + L, device=device)  # (B, 1+L)
    rows = group_of_row.unsqueeze(1)
    packed[rows, columns] = input_ids[:, P - 1 :]
    valid[rows, columns] = attention_mask[:, P - 1 :].bool()
    segment[rows, columns] = slot.unsqueeze(1)
    positions[rows, columns] = torch.arange(P - 1, width, device=device)
    completion_valid = attention_mask[:, P:].bool()
    labels[rows, columns[:, 1:]] = input_ids[:, P:].masked_fill(~completion_valid, -100)

    # Query s attends key t: t real, t <= s, and t in the shared prompt or in s's own segment. Every position also
    # attends itself, so that no query (a padding position) is left with nothing to attend: a fully masked row would
    # give NaN, which would reach real positions through their zero attention weights on it.
    index = torch.arange(length, device=device)
    causal = index.unsqueeze(0) <= index.unsqueeze(1)  # [s, t]: t <= s
    same_or_shared = (segment.unsqueeze(2) == segment.unsqueeze(1)) | (segment.unsqueeze(1) == -1)
    allowed = causal & same_or_shared & valid.unsqueeze(1)
    allowed |= torch.eye(length, dtype=torch.bool, device=device)
    return PackedRows(
        input_ids=packed,
        position_ids=positions,
        allowed=allowed,
        labels=labels,
        row_group=group_of_row,
        row_start=starts,  # in the shifted outputs, position starts + j scores the label at starts + 1 + j
        completion_length=L,
    )
