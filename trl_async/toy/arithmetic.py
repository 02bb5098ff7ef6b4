"""The arithmetic task of the bundled tiny model: seeded, deduplicated two-operand problems ("What is 23+58?") and
the worked solutions the model was pre-trained to produce (ending, like GSM8K, with ``#### <answer>``).

Rows use TRL's conversational format: ``prompt`` is a list of chat messages and ``answer`` the gold answer string.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["SUPPORTED_OPS", "arithmetic_prompt", "arithmetic_solution", "make_arithmetic_dataset"]

SUPPORTED_OPS = ("+", "-")


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
