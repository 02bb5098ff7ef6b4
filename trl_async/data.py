"""Datasets used by the examples, tests and the bundled tiny model.

* :func:`make_arithmetic_dataset` generates seeded, deduplicated two-operand arithmetic problems
  ("What is 23+58?") that the bundled tiny Qwen2 model (``trl_async.assets``) was pre-trained on.
* :func:`arithmetic_solution` is the worked-solution text that model was pre-trained to produce. Like
  GSM8K, it ends with ``#### <answer>``.
* :func:`load_gsm8k` loads GSM8K from the Hub or from a local ``.json``/``.jsonl`` file or folder with
  the same ``question``/``answer`` columns, and turns it into conversational prompts.
* :func:`extract_gsm8k_answer` pulls the final answer out of a ``#### N`` terminated text.

Rows produced here use TRL's conversational format: ``prompt`` is a list of chat messages and
``answer`` is the gold answer as a string.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence

__all__ = [
    "SUPPORTED_OPS",
    "GSM8K_INSTRUCTION",
    "arithmetic_prompt",
    "arithmetic_solution",
    "make_arithmetic_dataset",
    "extract_gsm8k_answer",
    "load_gsm8k",
]

SUPPORTED_OPS = ("+", "-")

GSM8K_INSTRUCTION = 'Solve the problem step by step, then finish with a final line "#### <number>".'


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"Unknown op {op!r}; supported ops are {list(SUPPORTED_OPS)}.")


def arithmetic_prompt(a: int, op: str, b: int) -> str:
    """The user message of an arithmetic problem, e.g. ``"What is 23+58?"``."""
    return f"What is {a}{op}{b}?"


def _digits(n: int) -> list[int]:
    """Decimal digits of ``n >= 0``, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _column_add(a: int, b: int) -> list[str]:
    da, db = _digits(a), _digits(b)
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+1={s}" if carry else f"{x}+{y}={s}")
        carry = s // 10
    return steps


def _column_sub(a: int, b: int) -> list[str]:
    """Column subtraction with borrowing; requires ``a >= b >= 0``."""
    da, db = _digits(a), _digits(b)
    steps, borrow = [], 0
    for i in range(len(da)):
        x = da[i]
        y = db[i] if i < len(db) else 0
        v = x - y - borrow
        if v < 0:
            v += 10
            x += 10  # borrow ten from the next column and show it
        steps.append(f"{x}-{y}-1={v}" if borrow else f"{x}-{y}={v}")
        borrow = 1 if x >= 10 else 0
    return steps


def arithmetic_solution(a: int, op: str, b: int) -> str:
    """Worked solution of ``a op b`` that ends with ``#### <answer>`` (the GSM8K answer marker).

    The solution is written column by column, least significant digit first, like school arithmetic:

    * ``47+38`` -> ``"7+8=15, 4+3+1=8. #### 85"`` (``+1`` is the carry)
    * ``83-47`` -> ``"13-7=6, 8-4-1=3. #### 36"`` (a borrowed ten is shown as ``13``, repaid by ``-1``)
    * ``23-58`` -> ``"-(58-23): 8-3=5, 5-2=3. #### -35"`` (a negative result swaps the operands first)

    Operands must be non-negative integers. For two-digit operands the text is 15-30 tokens with the
    bundled tokenizer (every digit is one token).
    """
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"Operand {name}={v!r} must be a non-negative int.")
    result = _apply(a, op, b)
    if op == "+":
        steps = ", ".join(_column_add(a, b))
        return f"{steps}. #### {result}"
    if a >= b:
        steps = ", ".join(_column_sub(a, b))
        return f"{steps}. #### {result}"
    steps = ", ".join(_column_sub(b, a))
    return f"-({b}-{a}): {steps}. #### {result}"


def make_arithmetic_dataset(
    num_train: int = 2000,
    num_test: int = 200,
    seed: int = 0,
    ops: Sequence[str] = SUPPORTED_OPS,
    operand_range: tuple[int, int] = (10, 99),
    allow_negative: bool = True,
):
    """Seeded arithmetic problems as a ``datasets.DatasetDict`` with ``"train"`` and ``"test"`` splits.

    Each row has ``prompt`` = ``[{"role": "user", "content": "What is 23+58?"}]`` and ``answer`` = the gold
    answer as a string (``"81"``). Operands ``a`` and ``b`` are drawn from ``operand_range`` (inclusive;
    two-digit by default) and each op from ``ops``. Every problem ``(a, op, b)`` occurs at most once across
    both splits, so train and test never share a problem. With ``allow_negative=False``, subtraction
    problems are restricted to ``a >= b``.

    The problems are a seeded shuffle of the whole problem space: the test split is its first
    ``num_test`` problems and the train split the next ``num_train``, so the test split for a given
    ``(seed, num_test, ops, operand_range, allow_negative)`` does not depend on ``num_train``.

    Raises ``ValueError`` for negative sizes, empty or unknown ops, a bad operand range, or sizes larger
    than the number of distinct problems.
    """
    from datasets import Dataset, DatasetDict

    for name, v in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}.")
    if isinstance(ops, str):
        ops = list(ops)  # "+-" -> ["+", "-"]
    ops = list(ops)
    if not ops:
        raise ValueError(f"ops is empty; pass at least one of {list(SUPPORTED_OPS)}.")
    unknown = [op for op in ops if op not in SUPPORTED_OPS]
    if unknown:
        raise ValueError(f"Unknown op(s) {unknown}; supported ops are {list(SUPPORTED_OPS)}.")
    ops = list(dict.fromkeys(ops))  # dedupe, keep order
    try:
        lo, hi = (int(x) for x in operand_range)
    except (TypeError, ValueError):
        raise ValueError(f"operand_range must be a pair (low, high) of ints, got {operand_range!r}.") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"operand_range must satisfy 0 <= low <= high, got {operand_range!r}.")

    problems = [
        (a, op, b)
        for op in ops
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
        if allow_negative or op != "-" or a >= b
    ]
    total = num_train + num_test
    if total > len(problems):
        raise ValueError(
            f"num_train + num_test = {num_train} + {num_test} = {total} exceeds the {len(problems)} distinct "
            f"problems for ops={ops}, operand_range={(lo, hi)}, allow_negative={allow_negative}; ask for fewer "
            "examples, add ops, or widen operand_range."
        )
    rng = random.Random(seed)
    rng.shuffle(problems)

    def rows(chunk):
        return {
            "prompt": [[{"role": "user", "content": arithmetic_prompt(a, op, b)}] for a, op, b in chunk],
            "answer": [str(_apply(a, op, b)) for a, op, b in chunk],
        }

    return DatasetDict(
        {
            "train": Dataset.from_dict(rows(problems[num_test:total])),
            "test": Dataset.from_dict(rows(problems[:num_test])),
        }
    )


_ANSWER_RE = re.compile(r"####[ \t]*([^\r\n]*)")


def extract_gsm8k_answer(text: str | None) -> str | None:
    """Final answer after the last ``####`` marker, or ``None`` when there is none.

    Normalisation (kept deliberately simple): the rest of the marker's line is taken, surrounding
    whitespace and a trailing ``.`` are stripped, thousands separators (``,``) and ``$`` signs are
    removed, and a trailing ``.0``/``.00`` is dropped. ``"#### 1,234.\\n"`` -> ``"1234"``. An empty answer
    (``"####"`` with nothing after it on the line) gives ``None``.
    """
    if not text:
        return None
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    ans = matches[-1].strip()
    ans = ans.replace(",", "").replace("$", "").strip()
    ans = ans.rstrip(".").strip()
    ans = re.sub(r"(?<=\d)\.0+$", "", ans)
    return ans or None


def looks_like_local_path(name: str) -> bool:
    """A local path rather than a Hub id ('org/name'): starts with `.`, `/` or `~`, ends with `/` or in .json/.jsonl,
    has two or more slashes, or exists."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith("/")
        or name.lower().endswith((".json", ".jsonl"))
        or name.count("/") > 1
        or os.path.exists(name)
    )


def _json_files(folder: str) -> list[str]:
    files = sorted(
        os.path.join(root, f)
        for root, _, names in os.walk(folder)
        for f in names
        if f.lower().endswith((".json", ".jsonl"))
    )
    if not files:
        raise FileNotFoundError(f"No .json/.jsonl files found in GSM8K folder {folder!r}.")
    return files


def gsm8k_prompt(question: str) -> list[dict[str, str]]:
    """Conversational prompt for a GSM8K question: the question plus a one-line answer-format instruction."""
    return [{"role": "user", "content": f"{question.strip()}\n{GSM8K_INSTRUCTION}"}]


def load_gsm8k(name_or_path: str = "openai/gsm8k", split: str = "train", config: str = "main"):
    """GSM8K as a ``datasets.Dataset`` with conversational ``prompt`` and extracted string ``answer``.

    ``name_or_path`` is either a local ``.json``/``.jsonl`` file or a folder of them (rows with ``question``
    and ``answer`` columns, ``answer`` ending in ``#### N``), loaded with ``load_dataset("json", ...)``, or a
    Hub dataset id, loaded with ``load_dataset(name_or_path, config, split=split)``. For local data the
    ``split`` and ``config`` arguments are ignored (all rows are returned).

    A string that looks like a path (``looks_like_local_path``) but does not exist raises ``FileNotFoundError`` at
    once, instead of being tried as a Hub id.
    """
    from datasets import load_dataset

    name_or_path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isfile(name_or_path):
        ds = load_dataset("json", data_files=[name_or_path], split="train")
    elif os.path.isdir(name_or_path):
        ds = load_dataset("json", data_files=_json_files(name_or_path), split="train")
    elif looks_like_local_path(name_or_path):
        raise FileNotFoundError(f"GSM8K data path {name_or_path!r} does not exist.")
    else:
        ds = load_dataset(name_or_path, config, split=split)

    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise ValueError(
            f"GSM8K data from {name_or_path!r} lacks column(s) {sorted(missing)}; "
            f"expected 'question' and 'answer', found {ds.column_names}."
        )

    def convert(row):
        return {"prompt": gsm8k_prompt(row["question"]), "answer": extract_gsm8k_answer(row["answer"])}

    extra = [c for c in ds.column_names if c not in ("question", "answer")]
    return ds.map(convert, remove_columns=["question", *extra])
