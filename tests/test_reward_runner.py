"""score_completions: decode at most once and only for text rewards; per-function output checks; NaN semantics."""

from __future__ import annotations

import math

import pytest
import torch

from trl_async.rewards import TensorReward, TokenPatternReward, score_completions, tensor_reward

EOS = 9
ROWS = [[1, 2, 3, EOS], [4, 1, 2], [5], [1, 1, 2, EOS]]
TEXTS = ["one two three", "four one two", "five", "one one two"]


def batch():
    ids = torch.zeros(len(ROWS), 5, dtype=torch.long)
    mask = torch.zeros(len(ROWS), 5, dtype=torch.long)
    for i, r in enumerate(ROWS):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


class CountingDecode:
    def __init__(self, texts=TEXTS):
        self.calls, self.texts = 0, texts

    def __call__(self):
        self.calls += 1
        return list(self.texts)


@tensor_reward
def mask_length(completion_ids, completion_mask, **kwargs):
    return completion_mask.float().sum(1)


def word_count(prompts, completions, completion_ids, **kwargs):
    return [float(len(c.split())) for c in completions]


def run(funcs, decode=None, columns=None, **kw):
    ids, mask = batch()
    decode = decode or CountingDecode()
    out = score_completions(funcs, ids, mask, columns or {"answer": ["a"] * 4}, prompts=["p"] * 4, decode=decode, **kw)
    return out, decode


def test_no_decode_when_every_reward_is_tensor_native():
    funcs = [TokenPatternReward(pattern=[1, 2], eos_token_id=EOS), mask_length]
    out, decode = run(funcs)
    assert decode.calls == 0
    assert out.shape == (4, 2) and out.dtype == torch.float32
    assert out[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out[:, 1].tolist() == [4.0, 3.0, 1.0, 4.0]


def test_decode_exactly_once_with_text_rewards_and_columns_in_order():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            answer=answer,
            trainer_state=trainer_state,
        )
        return [0.5, None, 1, True]

    funcs = [mask_length, word_count, TokenPatternReward(pattern=[1], eos_token_id=EOS), spy]
    out, decode = run(funcs, extra_kwargs={"trainer_state": "state", "log_extra": None, "log_metric": None})
    assert decode.calls == 1
    assert out[:, 0].tolist() == [4.0, 3.0, 1.0, 4.0]
    assert out[:, 1].tolist() == [3.0, 3.0, 1.0, 3.0]
    assert out[:, 2].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out[[0, 2, 3], 3].tolist() == [0.5, 1.0, 1.0] and math.isnan(out[1, 3])
    assert seen["completion_ids"] == ROWS  # unpadded, as TRL passes them
    assert seen["completions"] == TEXTS and seen["prompts"] == ["p"] * 4
    assert seen["answer"] == ["a"] * 4 and seen["trainer_state"] == "state"


def test_tensor_reward_receives_columns_and_extras():
    got = {}

    class Spy(TensorReward):
        def score(self, completion_ids, completion_mask, **columns):
            got.update(columns)
            return torch.zeros(completion_ids.shape[0])

    run([Spy()], columns={"answer": [1, 2, 3, 4]}, extra_kwargs={"trainer_state": 7})
    assert got == {"answer": [1, 2, 3, 4], "trainer_state": 7}


def make_tensor_reward(output, name):
    @tensor_reward(name=name)
    def f(completion_ids, completion_mask, **kwargs):
        return output

    return f


@pytest.mark.parametrize(
    "output,error,match",
    [
        (torch.zeros(3), ValueError, r"'bad_reward'.*shape \(3,\).*\(4,\)"),
        (torch.zeros(4, 1), ValueError, r"'bad_reward'.*shape \(4, 1\)"),
        (torch.zeros(4, dtype=torch.bool), TypeError, r"'bad_reward'.*torch.bool"),
        (torch.zeros(4, dtype=torch.long), TypeError, r"'bad_reward'.*torch.int64"),
        ([0.0] * 4, TypeError, r"'bad_reward'.*list"),
        (torch.zeros(4, device="meta"), ValueError, r"'bad_reward'.*meta"),
    ],
)
def test_tensor_reward_output_errors_name_the_function(output, error, match):
    with pytest.raises(error, match=match):
        run([mask_length, make_tensor_reward(output, "bad_reward")])


@pytest.mark.parametrize(
    "output,error,match",
    [
        ([1.0, 2.0], ValueError, r"'bad_text'.*returned 2 rewards.*4"),
        (["1", "0", "1", "0"], TypeError, r"'bad_text'.*'1'"),
        ([1.0, [1.0], 0.0, 0.0], TypeError, r"'bad_text'.*completion 1"),
        (1.0, TypeError, r"'bad_text'.*float"),
        ("1111", TypeError, r"'bad_text'.*str"),
    ],
)
def test_text_reward_output_errors_name_the_function(output, error, match):
    def bad_text(prompts, completions, completion_ids, **kwargs):
        return output

    with pytest.raises(error, match=match):
        run([bad_text])


def test_reward_func_names_override_in_errors():
    with pytest.raises(ValueError, match="'custom name'"):
        run([make_tensor_reward(torch.zeros(2), "x")], reward_func_names=["custom name"])


def test_nan_passes_through_and_is_not_zeroed():
    nan_tensor = make_tensor_reward(torch.tensor([1.0, float("nan"), 0.0, float("nan")]), "partial")

    def text_none(prompts, completions, completion_ids, **kwargs):
        return [None, 2.0, None, float("nan")]

    out, _ = run([nan_tensor, text_none])
    assert torch.isnan(out).tolist() == [[False, True], [True, False], [False, True], [True, True]]
    assert out[0, 0] == 1.0 and out[1, 1] == 2.0 and out[2, 0] == 0.0
    # Like TRL: a row where every function is NaN stays NaN (TRL then gives it zero advantage).
    assert torch.isnan(out[3]).all()


def test_ints_bools_and_numpy_scalars_are_converted_like_trl():
    import numpy as np

    def mixed(prompts, completions, completion_ids, **kwargs):
        return [1, True, np.float32(0.25), np.bool_(False)]

    out, _ = run([mixed])
    assert out[:, 0].tolist() == [1.0, 1.0, 0.25, 0.0]


def test_async_text_reward_and_model_rejected():
    async def slow(prompts, completions, completion_ids, **kwargs):
        return [1.0] * len(completions)

    out, decode = run([slow, mask_length])
    assert out[:, 0].tolist() == [1.0] * 4 and decode.calls == 1
    with pytest.raises(TypeError, match="model"):
        run([torch.nn.Linear(2, 1)])


def test_decode_length_is_checked():
    with pytest.raises(ValueError, match="decode"):
        run([word_count], decode=CountingDecode(TEXTS[:2]))


class RecordsPrepare(TensorReward):
    def __init__(self):
        super().__init__()
        self.prepared = []

    def prepare(self, **columns):
        self.prepared.append(columns)

    def score(self, completion_ids, completion_mask, **columns):
        return torch.zeros(completion_ids.shape[0])


class TextRewardWithPrepare:
    """A text reward that happens to have a `prepare` method: `prepare_rewards` leaves text rewards alone."""

    __name__ = "text_reward_with_prepare"

    def __init__(self):
        self.prepared = 0

    def prepare(self, **columns):
        self.prepared += 1

    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)


def test_prepare_rewards_calls_prepare_on_every_tensor_reward_only():
    import functools

    from trl_async.rewards import prepare_rewards

    plain, behind_partial, text = RecordsPrepare(), RecordsPrepare(), TextRewardWithPrepare()

    def marked(completion_ids, completion_mask, **kwargs):
        return completion_mask.float().sum(1)

    marked.__tensor_reward__ = True
    marked.prepared = []
    marked.prepare = lambda **columns: marked.prepared.append(columns)
    columns = {"answer": ["1", "2", "3"], "question": ["a", "b", "c"]}  # any length: a batch or a whole dataset
    funcs = [plain, functools.partial(behind_partial), text, word_count, mask_length, marked]
    assert prepare_rewards(funcs, columns) is None
    assert plain.prepared == [columns] and behind_partial.prepared == [columns] and marked.prepared == [columns]
    assert text.prepared == 0  # text rewards are never prepared
    # `mask_length` (a decorated function) has the default, do-nothing `prepare`: scoring is unchanged.
    out, decode = run([plain, mask_length])
    assert out[:, 1].tolist() == [4.0, 3.0, 1.0, 4.0] and decode.calls == 0


def test_prepare_rewards_wants_columns_as_a_dict():
    from trl_async.rewards import prepare_rewards

    with pytest.raises(TypeError, match="dict"):
        prepare_rewards([RecordsPrepare()], [["1", "2"]])
