"""Tensor-native reward protocol, TokenPatternReward, FormatReward and LengthPenalty, against plain-Python references.

The references below loop over rows and positions in the most literal way; the rewards under test never do.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_async.rewards import (
    FormatReward,
    LengthPenalty,
    TensorReward,
    TokenPatternReward,
    is_tensor_reward,
    tensor_reward,
)

EOS = 9
PAD = 0


# ----------------------------------------------------------------------------------------------- references
def valid_positions(ids_row, mask_row, eos_ids):
    """Positions that are inside the mask and strictly before the first EOS (anywhere in the row)."""
    out, seen_eos = [], False
    for t, m in zip(ids_row, mask_row, strict=True):
        if t in eos_ids:
            seen_eos = True
        out.append(bool(m) and not seen_eos)
    return out


def ref_pattern(ids_row, mask_row, pattern, eos_ids):
    valid = valid_positions(ids_row, mask_row, eos_ids)
    k = len(pattern)
    for s in range(len(ids_row) - k + 1):
        if all(valid[s + j] and ids_row[s + j] == pattern[j] for j in range(k)):
            return 1.0
    return 0.0


def ref_format(ids_row, mask_row, items, eos_ids):
    """items: list of lists of alternative token sequences. Exhaustive search for an in-order placement."""
    valid = valid_positions(ids_row, mask_row, eos_ids)
    occurrences = []
    for alts in items:
        occ = []
        for seq in alts:
            k = len(seq)
            for s in range(len(ids_row) - k + 1):
                if all(valid[s + j] and ids_row[s + j] == seq[j] for j in range(k)):
                    occ.append((s, s + k - 1))
        occurrences.append(occ)

    def place(i, after):
        if i == len(items):
            return True
        return any(start > after and place(i + 1, end) for start, end in occurrences[i])

    return 1.0 if place(0, -1) else 0.0


def as_batch(rows, masks=None, width=None):
    width = width or max([len(r) for r in rows] + [1])
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1 if masks is None else torch.tensor(masks[i][: len(r)])
    return ids, mask


# ----------------------------------------------------------------------------------------------- protocol
class CountTokens(TensorReward):
    def __init__(self, token, **kwargs):
        super().__init__(**kwargs)
        self.token = token

    def score(self, completion_ids, completion_mask, **columns):
        return ((completion_ids == self.token) & completion_mask.bool()).sum(1).float()


def test_names_follow_trl_conventions():
    from trl.trainer.utils import get_callable_name

    assert CountTokens(3).__name__ == "count_tokens"
    assert CountTokens(3, name="threes").__name__ == "threes"
    assert get_callable_name(CountTokens(3)) == "count_tokens"
    assert TokenPatternReward(pattern=[1]).__name__ == "token_pattern_reward"
    assert LengthPenalty(10).__name__ == "length_penalty"
    assert CountTokens.__name__ == "CountTokens"  # the class keeps its own name
    with pytest.raises(ValueError):
        CountTokens(3, name="")


def test_tensor_reward_decorator_and_marker():
    @tensor_reward
    def ones(completion_ids, completion_mask, **columns):
        return torch.ones(completion_ids.shape[0])

    @tensor_reward(name="zeros_please")
    def zeros(completion_ids, completion_mask, **columns):
        return torch.zeros(completion_ids.shape[0])

    assert is_tensor_reward(ones) and is_tensor_reward(zeros) and is_tensor_reward(CountTokens(1))
    assert ones.__name__ == "ones" and zeros.__name__ == "zeros_please"

    def plain(completions, **kwargs):
        return [0.0] * len(completions)

    assert not is_tensor_reward(plain)

    class Marked:
        __tensor_reward__ = True

    assert is_tensor_reward(Marked())
    assert ones(completion_ids=[[1, 2], [3]]) == [1.0, 1.0]


def test_trl_signature_path_agrees_with_tensor_path():
    lists = [[5, 3, 3, EOS], [3], [], [7, 7, 7, 7, 7, 3]]
    reward = CountTokens(3)
    # TRL's call: keyword arguments only, with the extras TRL always passes.
    out = reward(
        prompts=["p"] * 4,
        completions=["c"] * 4,
        completion_ids=lists,
        trainer_state=None,
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
        some_column=[1, 2, 3, 4],
    )
    assert isinstance(out, list) and all(isinstance(x, float) for x in out)
    ids, mask = as_batch(lists)
    tensor_out = reward(completion_ids=ids, completion_mask=mask, some_column=[1, 2, 3, 4])
    assert isinstance(tensor_out, torch.Tensor)
    assert out == tensor_out.tolist() == [2.0, 1.0, 0.0, 1.0]
    assert reward(ids, mask).tolist() == out  # positional form


def test_builtin_trl_path_agrees_with_tensor_path():
    rows = [[1, 2, 3, EOS, 1, 2], [4, 1, 2], [1], [], [2, 1, 2, 3]]
    ids, mask = as_batch(rows, masks=[[1] * len(r) for r in rows])
    for reward in (
        TokenPatternReward(pattern=[1, 2], eos_token_id=EOS),
        FormatReward(required=([1], [3])),
        LengthPenalty(4, 2),
    ):
        assert reward(prompts=[""] * 5, completions=[""] * 5, completion_ids=rows) == reward(ids, mask).tolist()


def test_decorated_module_level_reward_pickles():
    restored = pickle.loads(pickle.dumps(module_level_tensor_reward))
    assert restored is module_level_tensor_reward
    restored = pickle.loads(pickle.dumps(TokenPatternReward(pattern=[1, 2], eos_token_id=[EOS, 8])))
    ids, mask = as_batch([[1, 2], [2, 1]])
    assert restored(ids, mask).tolist() == [1.0, 0.0]


@tensor_reward
def module_level_tensor_reward(completion_ids, completion_mask, **columns):
    return completion_mask.float().sum(1)


# ----------------------------------------------------------------------------------------------- pattern
PATTERN_CASES = {
    # name: (row, mask or None, pattern, expected)
    "at position 0": ([1, 2, 3, EOS], None, [1, 2], 1.0),
    "ends at the last valid token": ([4, 4, 1, 2, EOS, 0], None, [1, 2], 1.0),
    "ends at the last token, no EOS": ([4, 4, 1, 2], None, [1, 2], 1.0),
    "crosses the first EOS": ([4, 1, EOS, 2], None, [1, EOS, 2], 0.0),
    "crosses the first EOS (prefix before)": ([4, 1, EOS, 2], None, [1, 2], 0.0),
    "only after the EOS": ([4, 4, EOS, 1, 2], None, [1, 2], 0.0),
    "after a second EOS": ([1, EOS, 1, 2, EOS], None, [1, 2], 0.0),
    "no EOS at all": ([3, 3, 1, 2, 3], None, [1, 2], 1.0),
    "longer than the completion": ([1, 2], None, [1, 2, 3], 0.0),
    "K=1 present": ([5, 6, 7], None, [7], 1.0),
    "K=1 only after EOS": ([5, EOS, 7], None, [7], 0.0),
    "all padding": ([], None, [1], 0.0),
    "masked out": ([1, 2, 3], [1, 0, 1], [1, 2], 0.0),
    "masked tail": ([3, 1, 2], [1, 1, 0], [1, 2], 0.0),
    "repeated prefix": ([1, 1, 1, 2], None, [1, 1, 2], 1.0),
}


@pytest.mark.parametrize("name", list(PATTERN_CASES))
def test_token_pattern_edge_cases(name):
    row, mask, pattern, expected = PATTERN_CASES[name]
    assert ref_pattern(row, mask or [1] * len(row), pattern, {EOS}) == expected  # the reference agrees
    ids, m = as_batch([row], masks=[mask] if mask else None, width=max(len(row), 1))
    reward = TokenPatternReward(pattern=pattern, eos_token_id=EOS)
    assert reward(ids, m).tolist() == [expected]
    # the same row inside a bigger, padded batch, and as a per-row pattern
    ids, m = as_batch([row, [1, 2, 3, 4, 5, 6, 7, 8]], masks=[mask, [1] * 8] if mask else None, width=12)
    assert reward(ids, m)[0].item() == expected
    per_row = TokenPatternReward(pattern_column="target", eos_token_id=EOS)
    assert per_row(ids, m, target=[pattern, [9, 9, 9, 9, 9]])[0].item() == expected


def test_token_pattern_all_padding_batch_and_b1():
    reward = TokenPatternReward(pattern=[1], eos_token_id=EOS)
    assert reward(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]
    assert reward(torch.tensor([[1]]), torch.tensor([[1]])).tolist() == [1.0]
    assert reward(torch.tensor([[1]]), torch.tensor([[0]])).tolist() == [0.0]


def test_token_pattern_per_row_patterns_of_different_lengths():
    rows = [[1, 2, 3, EOS], [1, 2, 3, EOS], [5, 6, 7, 8], [5, 6, EOS, 7], [4, 4, 4, 4]]
    targets = [[2, 3], [1, 2, 3, 4], [8], [6, 7], [4, 4, 4, 4]]
    ids, mask = as_batch(rows)
    out = TokenPatternReward(pattern_column="target_ids", eos_token_id=EOS)(ids, mask, target_ids=targets)
    assert (
        out.tolist()
        == [ref_pattern(r, [1] * 4, t, {EOS}) for r, t in zip(rows, targets, strict=True)]
        == [1, 0, 1, 0, 1]
    )


def test_token_pattern_multiple_eos_ids():
    ids, mask = as_batch([[1, 8, 1, 2], [1, 2, 8], [3, EOS, 1, 2]])
    assert TokenPatternReward(pattern=[1, 2], eos_token_id=[EOS, 8])(ids, mask).tolist() == [0.0, 1.0, 0.0]
    assert TokenPatternReward(pattern=[1, 2], eos_token_id=None)(ids, mask).tolist() == [1.0, 1.0, 1.0]


def test_token_pattern_empty_or_invalid_patterns_raise():
    with pytest.raises(ValueError, match="empty"):
        TokenPatternReward(pattern=[], eos_token_id=EOS)
    with pytest.raises(ValueError, match="exactly one"):
        TokenPatternReward(eos_token_id=EOS)
    with pytest.raises(ValueError, match="negative"):
        TokenPatternReward(pattern=[1, -1])
    reward = TokenPatternReward(pattern_column="t", eos_token_id=EOS)
    ids, mask = as_batch([[1, 2], [3]])
    with pytest.raises(ValueError, match="row 1"):
        reward(ids, mask, t=[[1], []])
    with pytest.raises(KeyError, match="'t'"):
        reward(ids, mask)


rows_strategy = st.lists(st.lists(st.integers(0, 9), max_size=12), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(rows=rows_strategy, data=st.data())
def test_token_pattern_matches_reference_random(rows, data):
    width = max(len(r) for r in rows) + data.draw(st.integers(0, 3))
    masks = [data.draw(st.lists(st.integers(0, 1), min_size=len(r), max_size=len(r))) for r in rows]
    if data.draw(st.booleans()):  # mostly TRL-style prefix masks, sometimes arbitrary
        masks = [[1] * len(r) for r in rows]
    patterns = [data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)) for _ in rows]
    eos_ids = data.draw(st.sampled_from([[EOS], [EOS, 8], []]))
    ids, mask = as_batch(rows, masks=masks, width=width)
    per_row = TokenPatternReward(pattern_column="p", eos_token_id=eos_ids or None)(ids, mask, p=patterns)
    expected = [
        ref_pattern(r + [PAD] * (width - len(r)), m + [0] * (width - len(m)), p, set(eos_ids))
        for r, m, p in zip(rows, masks, patterns, strict=True)
    ]
    assert per_row.tolist() == expected
    fixed = TokenPatternReward(pattern=patterns[0], eos_token_id=eos_ids or None)(ids, mask)
    assert fixed.tolist() == [
        ref_pattern(r + [PAD] * (width - len(r)), m + [0] * (width - len(m)), patterns[0], set(eos_ids))
        for r, m in zip(rows, masks, strict=True)
    ]


# ----------------------------------------------------------------------------------------------- format
def test_format_reward_order_and_eos():
    reward = FormatReward(required=([1, 2], [3], [4, 4]), eos_token_id=EOS)
    rows = [
        [1, 2, 3, 4, 4],  # in order
        [3, 1, 2, 4, 4],  # [3] before [1, 2] only -> no
        [1, 2, 3, 3, 1, 2, 4, 4],  # in order using later occurrences
        [1, 2, 3, EOS, 4, 4],  # last item after EOS
        [1, 2, 4, 4, 3],  # out of order
        [1, 2, 3, 4],  # incomplete
        [1, 2, 3, 4, 1, 4, 4],  # gap is fine
        [],
    ]
    ids, mask = as_batch(rows)
    items = [[[1, 2]], [[3]], [[4, 4]]]
    expected = [
        ref_format(r + [PAD] * (ids.shape[1] - len(r)), mask[i].tolist(), items, {EOS}) for i, r in enumerate(rows)
    ]
    assert expected == [1, 0, 1, 0, 0, 0, 1, 0]
    assert reward(ids, mask).tolist() == expected


def test_format_reward_alternatives_and_overlap():
    # item 0 has two spellings; items must not overlap ([2, 2] then [2] needs three 2s)
    reward = FormatReward(required=([[7, 2], [8]], [2, 2], [2]), eos_token_id=EOS)
    rows = [[7, 2, 2, 2], [8, 2, 2], [8, 2, 2, 2], [7, 2, 2]]
    ids, mask = as_batch(rows)
    items = [[[7, 2], [8]], [[2, 2]], [[2]]]
    expected = [ref_format(r + [PAD] * (4 - len(r)), mask[i].tolist(), items, {EOS}) for i, r in enumerate(rows)]
    assert expected == [0, 0, 1, 0]
    assert reward(ids, mask).tolist() == expected


@settings(max_examples=300, deadline=None)
@given(rows=rows_strategy, data=st.data())
def test_format_reward_matches_reference_random(rows, data):
    n_items = data.draw(st.integers(1, 3))
    items = [
        data.draw(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=2))
        for _ in range(n_items)
    ]
    width = max(len(r) for r in rows)
    ids, mask = as_batch(rows, width=max(width, 1))
    reward = FormatReward(required=items, eos_token_id=EOS)
    expected = [
        ref_format(r + [PAD] * (ids.shape[1] - len(r)), mask[i].tolist(), items, {EOS}) for i, r in enumerate(rows)
    ]
    assert reward(ids, mask).tolist() == expected


def test_format_reward_errors():
    with pytest.raises(ValueError, match="tokenizer"):
        FormatReward(required=("<think>",))
    with pytest.raises(ValueError, match="empty"):
        FormatReward(required=([1], []))


# ----------------------------------------------------------------------------------------------- length
@pytest.mark.parametrize("max_len,cache", [(100, 20), (10, 0), (10, 10), (7, 3)])
def test_length_penalty_matches_trl(max_len, cache):
    from trl.rewards import get_soft_overlong_punishment

    trl_reward = get_soft_overlong_punishment(max_len, cache)
    lists = [[1] * n for n in range(0, max_len + 15)]
    ours = LengthPenalty(max_len, cache)(completion_ids=lists)
    assert ours == pytest.approx(trl_reward(completion_ids=lists))
    ids, mask = as_batch(lists)
    assert LengthPenalty(max_len, cache, penalty=0.5)(ids, mask).tolist() == pytest.approx([0.5 * x for x in ours])


def test_length_penalty_validates():
    with pytest.raises(ValueError):
        LengthPenalty(0)
    with pytest.raises(ValueError):
        LengthPenalty(10, 11)


@settings(max_examples=200, deadline=None)
@given(rows=rows_strategy, data=st.data())
def test_suffix_table_search_path_equals_table_path(rows, data):
    from trl_async.rewards._tokens import SuffixTable

    n_items = data.draw(st.integers(1, 3))
    variants = data.draw(
        st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple), st.integers(0, n_items - 1)),
                 min_size=1, max_size=6)
    )  # fmt: skip
    ids, mask = as_batch(rows, width=max(max(len(r) for r in rows), 1))
    table = SuffixTable(variants, n_items)
    search = SuffixTable(variants, n_items, max_entries=1)
    assert table.lut is not None and search.lut is None
    valid = mask.bool()
    assert torch.equal(table.lookup(ids, valid).long(), search.lookup(ids, valid))
