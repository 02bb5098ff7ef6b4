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

With long completions packing saves too little for its attention cost, and the prompt is computed once another way:
as a key/value prefix (`split_prompt_prefix`, `prefix_forward`, below), one forward of the distinct prompts, then one
of every row's `[prompt[-1], completion]` reading its prompt's keys and values through a read-only cache.

`pack_prompt_groups` builds the packed batch and `PackedRows.unpack` maps per-position outputs back to TRL's (B, L)
layout; `split_prompt_prefix` builds the prefix batch. These are pure tensor code. `prefix_forward` is the one
function here that calls the model.

`shared_prompt_logps` (at the end) is what the trainers call in place of TRL's forward: it packs where packing pays,
runs the prefix where that does, and leaves TRL's forward to the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from accelerate.utils import DistributedType

from ..config import async_field


def kernel_mask(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """(N, Q, K) bool "query may attend key" -> the 4-D mask transformers' attention takes as given: boolean for
    `sdpa`, additive for `eager`."""
    mask = allowed.unsqueeze(1)
    if attn_implementation == "sdpa":
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


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
        return kernel_mask(self.allowed, attn_implementation, dtype)

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


@dataclasses.dataclass(frozen=True)
class _PromptGroups:
    """Rows `[prompt, completion]` grouped by identical prompts (same tokens and same padding)."""

    prompt_width: int  # P: the batch's width less logits_to_keep
    group_of_row: torch.Tensor  # (B,) each row's group
    first_row: torch.Tensor  # (N,) one row of each group

    @property
    def num_groups(self) -> int:
        return self.first_row.numel()


def _prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, min_prompt_width: int
) -> _PromptGroups | None:
    """The prompt groups of TRL's layout (left-padded prompts, then `logits_to_keep` completion columns); None when
    there is nothing to share: fewer than two rows, or prompts narrower than `min_prompt_width`."""
    num_rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    if prompt_width < min_prompt_width or num_rows < 2:
        return None
    prompts = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width].to(input_ids.dtype)], dim=1)
    _, group_of_row = torch.unique(prompts, dim=0, return_inverse=True)
    num_groups = int(group_of_row.max()) + 1
    first_row = torch.zeros(num_groups, dtype=torch.long, device=input_ids.device)
    first_row[group_of_row.flip(0)] = torch.arange(num_rows - 1, -1, -1, device=input_ids.device)
    return _PromptGroups(prompt_width, group_of_row, first_row)


def pack_prompt_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    min_saving: float = 0.2,
) -> PackedRows | None:
    """Pack rows `[prompt, completion]` (left-padded prompts, right-padded completions: TRL's layout) whose prompts are
    identical (same tokens, same padding) into one sequence per prompt; None if that saves less than `min_saving` of
    the tokens (e.g. every prompt distinct), or if a prompt is shorter than one token."""
    groups = _prompt_groups(input_ids, attention_mask, logits_to_keep, min_prompt_width=1)
    if groups is None:
        return None
    (num_rows, width), L, P = input_ids.shape, logits_to_keep, groups.prompt_width
    group_of_row, first_row, num_groups = groups.group_of_row, groups.first_row, groups.num_groups
    device = input_ids.device
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


# ------------------------------------------------------------------------------------------------ prompt as a prefix
# Where packing saves too little (long completions: the packed sequence's dense (S, S) attention costs more than the
# prompt tokens it saves), the prompt is still computed once per group, as a key/value prefix: one forward of the N
# distinct prompts records each layer's keys and values, and one forward of the B rows' completions attends to its
# group's prefix through a read-only cache. Tokens: N·(P−1) + B·(1+L) instead of B·(P+L), and each row's attention is
# (1+L) × (P+L), no larger than in TRL's forward.


@dataclasses.dataclass
class PromptPrefix:
    prefix_ids: torch.Tensor  # (N, P−1) each distinct prompt but its last token
    prefix_position_ids: torch.Tensor  # (N, P−1)
    prefix_allowed: torch.Tensor  # (N, P−1, P−1) bool: causal over the prompt's real tokens
    row_group: torch.Tensor  # (B,) the prefix row b attends to
    suffix_ids: torch.Tensor  # (B, 1+L) the prompt's last token, then the completion
    suffix_position_ids: torch.Tensor  # (B, 1+L): P−1, ..., P+L−1, the positions they have in TRL's row
    suffix_allowed: torch.Tensor  # (B, 1+L, P−1 + 1+L) bool: the group's real prompt tokens, then causal over itself
    labels: torch.Tensor  # (B, 1+L) the completion where it is real, −100 elsewhere (TRL's labels, less the prompt)


def split_prompt_prefix(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    min_saving: float = 0.1,
) -> PromptPrefix | None:
    """Split rows `[prompt, completion]` (TRL's layout) into one prefix per distinct prompt (same tokens and padding)
    and each row's suffix `[prompt[-1], completion]`; None if that saves less than `min_saving` of the tokens."""
    groups = _prompt_groups(input_ids, attention_mask, logits_to_keep, min_prompt_width=2)
    if groups is None:
        return None
    (num_rows, width), L, P = input_ids.shape, logits_to_keep, groups.prompt_width
    if groups.num_groups * (P - 1) + num_rows * (1 + L) > (1 - min_saving) * num_rows * width:
        return None
    row_group, first_row, num_groups = groups.group_of_row, groups.first_row, groups.num_groups
    device = input_ids.device
    prefix_valid = attention_mask[first_row, : P - 1].bool()  # (N, P−1): left padding is False
    suffix_valid = attention_mask[:, P - 1 :].bool()  # (B, 1+L): right padding is False
    # Every query also attends itself, so that none (a padding position) is left with nothing to attend: a fully
    # masked row gives NaN, which would reach real positions through their zero attention weights on it.
    prefix_causal = torch.ones(P - 1, P - 1, dtype=torch.bool, device=device).tril()
    prefix_allowed = prefix_causal & prefix_valid.unsqueeze(1)
    prefix_allowed |= torch.eye(P - 1, dtype=torch.bool, device=device)
    suffix_causal = torch.ones(1 + L, 1 + L, dtype=torch.bool, device=device).tril()
    own = suffix_causal & suffix_valid.unsqueeze(1)
    own |= torch.eye(1 + L, dtype=torch.bool, device=device)
    shared = prefix_valid[row_group].unsqueeze(1).expand(-1, 1 + L, -1)
    labels = input_ids[:, P - 1 :].masked_fill(~suffix_valid, -100)
    labels[:, 0] = -100  # the prompt's last token is context here; it predicts the first completion token
    positions = torch.arange(width, device=device)
    return PromptPrefix(
        prefix_ids=input_ids[first_row, : P - 1],
        prefix_position_ids=positions[: P - 1].expand(num_groups, -1),
        prefix_allowed=prefix_allowed,
        row_group=row_group,
        suffix_ids=input_ids[:, P - 1 :],
        suffix_position_ids=positions[P - 1 :].expand(num_rows, -1),
        suffix_allowed=torch.cat([shared, own], dim=2),
        labels=labels,
    )


class _PrefixRecorder:
    """Duck-typed transformers cache for the prompts' forward: `update` keeps each layer's keys and values and returns
    them as given (the prompts attend to themselves only). A replay under gradient checkpointing overwrites them with
    equal values, which nothing reads any more: the completions read a `_PrefixReader` made before."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states


class _PrefixReader:
    """Duck-typed transformers cache for the completions' forward: `update` returns the group's prefix in front of the
    new keys and values, and stores nothing. Being read-only, the completion forward can be replayed under gradient
    checkpointing and read the same prefix."""

    def __init__(self, recorder: _PrefixRecorder, row_group: torch.Tensor):
        self.keys, self.values, self.row_group = dict(recorder.keys), dict(recorder.values), row_group
        self.reads = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.reads += 1
        keys = torch.cat([self.keys[layer_idx][self.row_group], key_states], dim=-2)
        values = torch.cat([self.values[layer_idx][self.row_group], value_states], dim=-2)
        return keys, values


@contextlib.contextmanager
def _checkpointed_layers_keep_cache(model: torch.nn.Module):
    """transformers' gradient-checkpointed layers drop a cache argument (a cache written in the forward would be
    written again by the backward's replay); a read-only one is safe, and layers that only read may say so with
    `_can_checkpoint_with_cache`. Set on the layer instances for the duration of the call."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_can_checkpoint_with_cache", None)


def _checkpointed_layers_may_keep_a_cache() -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")


def prefix_survives_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the completions' forward can read the prompt's keys and values under `model`'s gradient checkpointing:
    yes if no layer is checkpointed; else every checkpointed layer must replay in the graph (non-reentrant, TRL's
    default: reentrant checkpointing runs a layer without autograd, so the prefix would get none of the completions'
    gradient) and transformers must let a layer keep a read-only cache (`_can_checkpoint_with_cache`, transformers
    >= 5.20; before, a checkpointed layer drops any cache)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing:
            if not _checkpointed_layers_may_keep_a_cache():
                return False
            settings = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", None) or {}
            if settings.get("use_reentrant", True) is not False:
                return False
    return True


def prefix_forward(
    model: torch.nn.Module,
    backbone: torch.nn.Module,
    prefix: PromptPrefix,
    attn_implementation: str,
    dtype: torch.dtype,
) -> object:
    """The completions' outputs of TRL's fused-head forward (`log_probs`, `entropy`: (B, L), 0 where a label is
    masked), with each prompt computed once: `backbone` (the model's decoder, `model.base_model` under any PEFT or
    accelerate wrapper) runs the N prefixes, then `model` the B suffixes through TRL's fused LM head. Check
    `prefix_survives_checkpointing(model)` first."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    cache_name = ALL_CACHE_NAMES[0]  # "cache" (transformers >= 5.20) or "past_key_values"
    recorder = _PrefixRecorder()
    # Masks given per layer type, as `generate` gives them: the model takes them as they are.
    with _checkpointed_layers_keep_cache(backbone):
        backbone(
            input_ids=prefix.prefix_ids,
            attention_mask={"full_attention": kernel_mask(prefix.prefix_allowed, attn_implementation, dtype)},
            position_ids=prefix.prefix_position_ids,
            use_cache=False,
            **{cache_name: recorder},
        )
        reader = _PrefixReader(recorder, prefix.row_group)
        outputs = model(
            input_ids=prefix.suffix_ids,
            attention_mask={"full_attention": kernel_mask(prefix.suffix_allowed, attn_implementation, dtype)},
            position_ids=prefix.suffix_position_ids,
            labels=prefix.labels,
            fused_lm_head=True,
            **{cache_name: reader},
        )
    if reader.reads != len(reader.keys) or not reader.keys:  # a layer ran without its prompt: wrong outputs
        raise RuntimeError(
            f"{reader.reads} attention calls read the prompt prefix of {len(reader.keys)} layers recorded: this model's"
            " layers do not take transformers' cache argument as expected. Set shared_prompt_forward='off'."
        )
    return outputs


# ----------------------------------------------------------------------------------------------- the trainers' forward
def shared_prompt_logps(
    trainer, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
    multimodal_inputs: dict, trl_forward,
):  # fmt: skip
    """TRL's `(logps, entropies, aux_loss)` computed with shared prompts, or None where TRL's forward must run:
    `shared_prompt_forward` off (or "auto" off the CPU), multimodal inputs, an MoE load-balancing loss, or an attention
    kernel that takes no dense mask. Each of TRL's `batch_size` chunks is packed on its own; a chunk where neither
    packing nor the prefix saves enough runs TRL's forward, `trl_forward(input_ids, attention_mask)`."""
    packing = _packing_settings(trainer, model)
    if packing is None or compute_aux_loss or any(v is not None for v in multimodal_inputs.values()):
        return None
    attn_implementation, dtype = packing
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        packed = pack_prompt_groups(ids, mask, logits_to_keep)
        if packed is not None:
            with trainer.accelerator.autocast():
                outputs = model(
                    input_ids=packed.input_ids,
                    attention_mask=packed.attention_mask(attn_implementation, dtype),
                    position_ids=packed.position_ids,
                    labels=packed.labels,
                    fused_lm_head=True,
                )
            logps = packed.unpack(outputs.log_probs)
            entropies = packed.unpack(outputs.entropy) if compute_entropy else None
        elif (
            outputs := _prefix_forward(trainer, model, ids, mask, logits_to_keep, attn_implementation, dtype)
        ) is not None:
            logps, entropies = outputs.log_probs, outputs.entropy if compute_entropy else None
        else:
            logps, entropies, _ = trl_forward(ids, mask)
        all_logps.append(logps)
        all_entropies.append(entropies)
    return torch.cat(all_logps), torch.cat(all_entropies) if compute_entropy else None, None


def _packing_settings(trainer, model) -> tuple[str, torch.dtype] | None:
    """(attention implementation, dtype) when the packed forward applies to `model`, else None."""
    mode = async_field(trainer.args, "shared_prompt_forward")
    if mode == "off" or (mode == "auto" and trainer.accelerator.device.type != "cpu"):
        return None
    config = getattr(trainer._unwrap(model), "config", None)
    attn_implementation = getattr(config, "_attn_implementation", None)
    if attn_implementation not in ("sdpa", "eager") or config.get_text_config() is not config:
        return None  # flash / flex kernels take no dense mask; a vision-language model's inputs are not all text
    return attn_implementation, next(model.parameters()).dtype


def _prefix_forward(trainer, model, input_ids, attention_mask, logits_to_keep, attn_implementation, dtype):
    """TRL's fused-head outputs for the rows with each prompt run once as a key/value prefix
    (`prefix_forward`), or None where that does not apply: too small a saving, a model wrapped for
    distributed training (DDP, FSDP, DeepSpeed reduce gradients per forward call, and this is two calls), a model
    with other than full-attention layers, or gradient checkpointing that would drop or detach the prefix
    (`prefix_survives_checkpointing`)."""
    unwrapped = trainer._unwrap(model)
    if trainer.accelerator.distributed_type != DistributedType.NO or unwrapped is not model:
        return None
    if set(getattr(unwrapped.config, "layer_types", None) or ["unknown"]) != {"full_attention"}:
        return None
    if torch.is_grad_enabled() and not prefix_survives_checkpointing(unwrapped):
        return None
    prefix = split_prompt_prefix(input_ids, attention_mask, logits_to_keep)
    if prefix is None:
        return None
    # PEFT's `PeftModel` API, duck-typed: `unwrapped` is already bare, and accelerate's `is_peft_model` unwraps again
    # and re-reads package metadata (~2 ms at every training step).
    backbone = (unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped).base_model
    with trainer.accelerator.autocast():
        return prefix_forward(model, backbone, prefix, attn_implementation, dtype)
