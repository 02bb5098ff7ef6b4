"""Text-level fallbacks: ordinary TRL reward functions (they need decoded completions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._answers import (
    DEFAULT_MARKERS,
    DEFAULT_PREFIXES,
    DEFAULT_SEPARATORS,
    answer_regex,
    marker_regex,
    normalize_answer,
)

__all__ = ["math_answer_text_reward", "MathAnswerTextReward", "completion_text"]


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a plain string, or a conversational list of messages (the assistant
    messages' `content` joined; content given as a list of `{"type": "text", "text": ...}` parts is supported)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content", "")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content or "")
    return "".join(parts)


class MathAnswerTextReward:
    """Text version of [`MathAnswerReward`]: the same answer semantics (see `trl_async/rewards/_answers.py`),
    applied with a regex to decoded text. 1.0 when the last marker is followed by the gold answer, else 0.0; `None`
    (TRL: "does not apply") when the gold answer is missing."""

    def __init__(
        self,
        markers: Sequence[str] = DEFAULT_MARKERS,
        separators: Sequence[str] = DEFAULT_SEPARATORS,
        prefixes: Sequence[str] = DEFAULT_PREFIXES,
        answer_column: str = "answer",
        name: str = "math_answer_text_reward",
    ):
        self.markers, self.separators, self.prefixes = tuple(markers), tuple(separators), tuple(prefixes)
        self.answer_column = answer_column
        self.__name__ = name
        self._marker_re = marker_regex(self.markers)

    def score_text(self, text: str, gold: Any) -> float | None:
        gold = normalize_answer(gold)
        if gold is None:
            return None
        last = None
        for last in self._marker_re.finditer(text):  # noqa: B007 - we want the last match
            pass
        if last is None:
            return 0.0
        pattern = answer_regex(gold, self.separators, self.prefixes)
        return 1.0 if pattern.match(text, last.end()) else 0.0

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        if self.answer_column not in kwargs:
            raise KeyError(f"{self.__name__} needs the dataset column {self.answer_column!r}")
        answers = kwargs[self.answer_column]
        return [self.score_text(completion_text(c), a) for c, a in zip(completions, answers, strict=True)]


_DEFAULT = MathAnswerTextReward()


def math_answer_text_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: 1.0 when a completion's final answer equals the row's `answer`, else 0.0.

    Works on plain-string and conversational completions. Same semantics as the tensor-native
    [`MathAnswerReward`] (last `#### ` / `\\boxed{` / `The answer is` marker decides; token-boundary-exact number
    match; `1,000` == `1000`, `$42`, `12.0` == `12`, negatives). `None` for rows with no gold answer.
    """
    return _DEFAULT(completions, answer=answer)
