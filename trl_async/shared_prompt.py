"""One forward per prompt group: a GRPO batch's completions share their prompt, so compute it once.

GRPO samples `num_generations` completions per prompt, and TRL's training forward runs every row as
`[prompt, completion]`, computing each prompt `num_generations` times, and every completion padded to the batch's
longest. With prompts of P tokens, completions padded to L and G rows a group, the forward costs G·(P+L) tokens a
group; packed, each completion cut after its last real token (n_i tokens), it costs (P−1) + Σ_i (1+n_i):

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
    row_length: torch.Tensor  # (B,) n_b: row b's completion up to its last real token (the rest was not packed)
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
        them) → (B, L) in TRL's row order, the completion tokens' values; 0 past a row's last real token, as TRL's
        fused head gives for a token whose label is masked."""
        device = per_position.device
        offsets = torch.arange(self.completion_length, device=device)
        in_segment = offsets.unsqueeze(0) < self.row_length.to(device).unsqueeze(1)
        columns = (self.row_start.to(device).unsqueeze(1) + offsets).clamp(max=per_position.size(1) - 1)
        values = per_position[self.row_group.to(device).unsqueeze(1), columns]
        return values.masked_fill(~in_segment, 0)


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
    device = input_ids.device
    prompts = torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], dim=1)
    _, group_of_row = torch.unique(prompts, dim=0, return_inverse=True)
    num_groups = int(group_of_row.max()) + 1
    # Each row's completion is cut after its last real token: right padding is neither computed nor attended to.
    completion_valid = attention_mask[:, P:].bool()
    real_length = (completion_valid * torch.arange(1, L + 1, device=device)).amax(dim=1)  # (B,) last real token + 1
    segment_length = 1 + real_length  # the prompt's last token, then the completion
    # Rows in (group, row) order; the slot of a row is its place in its group.
    order = torch.argsort(group_of_row * num_rows + torch.arange(num_rows, device=device))
    sizes = torch.bincount(group_of_row, minlength=num_groups)
    first_of_group = torch.cumsum(sizes, 0) - sizes
    slot = torch.empty_like(group_of_row)
    slot[order] = torch.arange(num_rows, device=device) - first_of_group[group_of_row[order]]
    # Segment start = (P-1) + the lengths of the group's earlier segments.
    ends_in_order = torch.cumsum(segment_length[order], 0)
    group_base = torch.zeros(num_groups, dtype=torch.long, device=device)
    group_base[1:] = ends_in_order[torch.cumsum(sizes, 0)[:-1] - 1]
    starts = torch.empty_like(segment_length)
    starts[order] = (P - 1) + ends_in_order - segment_length[order] - group_base[group_of_row[order]]
    group_length = (P - 1) + torch.zeros(num_groups, dtype=torch.long, device=device).index_add_(
        0, group_of_row, segment_length
    )
    length = int(group_length.max())
    if num_groups * length > (1 - min_saving) * num_rows * width:
        return None

    # The packed tokens. Row b's segment occupies [starts_b, starts_b + 1 + n_b): the prompt's last token, then its
    # n_b completion tokens. Shorter groups are padded at the end (not attended to, never read).
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
    offsets = torch.arange(1 + L, device=device)
    kept = offsets.unsqueeze(0) < segment_length.unsqueeze(1)  # (B, 1+L): the segment's columns
    rows = group_of_row.unsqueeze(1).expand(-1, 1 + L)[kept]
    columns = (starts.unsqueeze(1) + offsets)[kept]
    packed[rows, columns] = input_ids[:, P - 1 :][kept]
    valid[rows, columns] = attention_mask[:, P - 1 :].bool()[kept]
    segment[rows, columns] = slot.unsqueeze(1).expand(-1, 1 + L)[kept]
    positions[rows, columns] = (P - 1 + offsets).expand(num_rows, -1)[kept]
    label_values = torch.cat([input_ids[:, :1], input_ids[:, P:].masked_fill(~completion_valid, -100)], dim=1)
    labels[rows, columns] = label_values.masked_fill(offsets == 0, -100)[
        kept
    ]  # the prompt's token predicts nothing here

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
        row_length=real_length,
        completion_length=L,
    )
