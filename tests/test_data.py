"""Tests for trl_async.data: arithmetic problems, worked solutions, GSM8K loading and answer extraction."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from trl_async.data import extract_gsm8k_answer, load_gsm8k
from trl_async.toy import arithmetic_solution, make_arithmetic_dataset

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_test_sample50.jsonl")
PROMPT_RE = re.compile(r"What is (\d+)([+-])(\d+)\?")
NUMBER_RE = re.compile(r"-?\d+(\.\d+)?")


def _problems(split):
    out = []
    for prompt in split["prompt"]:
        assert isinstance(prompt, list) and len(prompt) == 1
        assert prompt[0]["role"] == "user"
        m = PROMPT_RE.fullmatch(prompt[0]["content"])
        assert m is not None, prompt
        out.append((int(m.group(1)), m.group(2), int(m.group(3))))
    return out


def _value(a, op, b):
    return a + b if op == "+" else a - b


# ---------------------------------------------------------------- make_arithmetic_dataset


@pytest.fixture(scope="module")
def default_ds():
    return make_arithmetic_dataset()


def test_default_sizes_and_columns(default_ds):
    assert set(default_ds.keys()) == {"train", "test"}
    assert len(default_ds["train"]) == 2000
    assert len(default_ds["test"]) == 200
    for split in ("train", "test"):
        assert default_ds[split].column_names == ["prompt", "answer"]
        assert all(isinstance(a, str) for a in default_ds[split]["answer"])


def test_splits_disjoint_and_unique(default_ds):
    train, test = _problems(default_ds["train"]), _problems(default_ds["test"])
    assert len(set(train)) == len(train)
    assert len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_answers_are_correct_and_defaults_are_two_digit_plus_minus(default_ds):
    ops = set()
    for split in ("train", "test"):
        for (a, op, b), ans in zip(_problems(default_ds[split]), default_ds[split]["answer"], strict=True):
            assert 10 <= a <= 99 and 10 <= b <= 99
            assert ans == str(_value(a, op, b))
            ops.add(op)
    assert ops == {"+", "-"}


def test_seeded_determinism():
    a = make_arithmetic_dataset(num_train=300, num_test=50, seed=7)
    b = make_arithmetic_dataset(num_train=300, num_test=50, seed=7)
    c = make_arithmetic_dataset(num_train=300, num_test=50, seed=8)
    for split in ("train", "test"):
        assert a[split].to_list() == b[split].to_list()
    assert a["train"].to_list() != c["train"].to_list()


def test_test_split_does_not_depend_on_num_train(default_ds):
    other = make_arithmetic_dataset(num_train=50, num_test=200, seed=0)
    assert other["test"].to_list() == default_ds["test"].to_list()


def test_ops_range_and_nonnegative_options():
    ds = make_arithmetic_dataset(num_train=30, num_test=10, ops=["-"], operand_range=(1, 9), allow_negative=False)
    probs = _problems(ds["train"]) + _problems(ds["test"])
    assert {op for _, op, _ in probs} == {"-"}
    assert all(1 <= a <= 9 and 1 <= b <= 9 and a >= b for a, _, b in probs)
    assert all(int(x) >= 0 for x in list(ds["train"]["answer"]) + list(ds["test"]["answer"]))
    # the whole problem space can be used: 9*10/2 = 45 problems with a >= b
    full = make_arithmetic_dataset(num_train=40, num_test=5, ops="-", operand_range=(1, 9), allow_negative=False)
    assert len(set(_problems(full["train"]) + _problems(full["test"]))) == 45


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_train": 20000, "num_test": 200}, r"20200 exceeds the 16200 distinct problems"),
        ({"num_train": 5, "num_test": 1, "ops": ["+"], "operand_range": (1, 2)}, r"6 exceeds the 4 distinct"),
        ({"num_train": -1}, r"num_train must be a non-negative int"),
        ({"num_test": -5}, r"num_test must be a non-negative int"),
        ({"num_train": 2.5}, r"num_train must be a non-negative int"),
        ({"ops": []}, r"ops is empty; pass at least one of"),
        ({"ops": ["+", "*"]}, r"Unknown op\(s\) \['\*'\]; supported ops are"),
        ({"operand_range": (50, 10)}, r"0 <= low <= high"),
        ({"operand_range": (-3, 10)}, r"0 <= low <= high"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_arithmetic_dataset(**kwargs)


def test_too_many_examples_message_says_what_to_do():
    with pytest.raises(ValueError) as ei:
        make_arithmetic_dataset(num_train=20000)
    assert "ask for fewer examples" in str(ei.value)


# ---------------------------------------------------------------- arithmetic_solution

STEP_RE = re.compile(r"(\d+)([+-])(\d+)([+-]1)?=(\d+)")


def _check_steps(text):
    body = text.split(" #### ")[0].rstrip(".")
    if body.startswith("-("):
        body = body.split(": ", 1)[1]
    for step in body.split(", "):
        m = STEP_RE.fullmatch(step)
        assert m is not None, (text, step)
        x, op, y, extra, rhs = m.groups()
        lhs = _value(int(x), op, int(y)) + (int(extra) if extra else 0)
        assert lhs == int(rhs), (text, step)


def test_solution_examples():
    assert arithmetic_solution(47, "+", 38) == "7+8=15, 4+3+1=8. #### 85"
    assert arithmetic_solution(83, "-", 47) == "13-7=6, 8-4-1=3. #### 36"
    assert arithmetic_solution(23, "-", 58) == "-(58-23): 8-3=5, 5-2=3. #### -35"
    assert arithmetic_solution(99, "+", 99) == "9+9=18, 9+9+1=19. #### 198"


def test_all_two_digit_solutions_end_with_answer_and_steps_are_true():
    for op in "+-":
        for a in range(10, 100):
            for b in range(10, 100):
                text = arithmetic_solution(a, op, b)
                gold = str(_value(a, op, b))
                assert text.endswith(f"#### {gold}"), text
                assert extract_gsm8k_answer(text) == gold
                _check_steps(text)


def test_solution_other_operand_sizes():
    for a, op, b in [(5, "+", 7), (100, "-", 1), (1234, "+", 9), (3, "-", 250), (0, "-", 0)]:
        text = arithmetic_solution(a, op, b)
        assert extract_gsm8k_answer(text) == str(_value(a, op, b)), text
        _check_steps(text)


@pytest.mark.parametrize("args", [(-1, "+", 3), (3, "*", 4), (2.0, "+", 1)])
def test_solution_bad_arguments(args):
    with pytest.raises(ValueError):
        arithmetic_solution(*args)


# ---------------------------------------------------------------- GSM8K


def _fixture_rows():
    with open(FIXTURE) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_extract_on_fixture_rows():
    rows = _fixture_rows()
    assert len(rows) == 50
    for row in rows:
        ans = extract_gsm8k_answer(row["answer"])
        assert ans is not None and NUMBER_RE.fullmatch(ans), (ans, row["answer"][-40:])
        # it is exactly what follows the marker, minus separators
        assert ans == row["answer"].rsplit("####", 1)[1].strip().replace(",", "")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so 2+2=4\n#### 4", "4"),
        ("#### 1,234", "1234"),
        ("#### $18", "18"),
        ("#### 72.0", "72"),
        ("#### 72.00\n", "72"),
        ("#### 3.5", "3.5"),
        ("#### -35", "-35"),
        ("####42", "42"),
        ("#### 85.", "85"),
        ("#### 7 \nextra text after the answer line", "7"),
        ("#### 1\n#### 2", "2"),
        ("The answer is 5.", None),
        ("####", None),
        ("#### \n5", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_edge_cases(text, expected):
    assert extract_gsm8k_answer(text) == expected


def _check_loaded(ds, rows):
    assert len(ds) == 50
    assert set(ds.column_names) == {"prompt", "answer"}
    for got, row in zip(ds, rows, strict=True):
        prompt = got["prompt"]
        assert isinstance(prompt, list) and len(prompt) == 1 and prompt[0]["role"] == "user"
        assert prompt[0]["content"].startswith(row["question"].strip())
        assert "#### <number>" in prompt[0]["content"]
        assert got["answer"] == extract_gsm8k_answer(row["answer"])


def test_load_gsm8k_local_file():
    _check_loaded(load_gsm8k(FIXTURE), _fixture_rows())


def test_load_gsm8k_local_folder(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "test.jsonl")
    _check_loaded(load_gsm8k(str(tmp_path)), _fixture_rows())


@pytest.mark.parametrize(
    "missing",
    [
        os.path.join("no", "such", "dir", "gsm8k.jsonl"),  # has a separator
        os.path.join("no_such_dir", ""),  # a folder-looking path
        "missing_gsm8k.json",  # no separator, but a .json name
        "missing_gsm8k.JSONL",
    ],
)
def test_load_gsm8k_missing_local_path(missing):
    assert not os.path.exists(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
        load_gsm8k(missing)


def test_load_gsm8k_bad_columns(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"q": "x", "a": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="lacks column"):
        load_gsm8k(str(p))
