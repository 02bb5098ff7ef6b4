"""Math datasets in GSM8K format (the arithmetic task of the bundled tiny model is `trl_async.toy`).

* :func:`load_gsm8k` loads GSM8K from the Hub or from a local ``.json``/``.jsonl`` file or folder with
  the same ``question``/``answer`` columns, and turns it into conversational prompts.
* :func:`extract_gsm8k_answer` pulls the final answer out of a ``#### N`` terminated text.

Rows produced here use TRL's conversational format: ``prompt`` is a list of chat messages and
``answer`` is the gold answer as a string.
"""

from __future__ import annotations

import os
import re

__all__ = ["GSM8K_INSTRUCTION", "extract_gsm8k_answer", "load_gsm8k", "looks_like_local_path"]

GSM8K_INSTRUCTION = 'Solve the problem step by step, then finish with a final line "#### <number>".'


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


def __getattr__(name):  # PEP 562: names that moved away (the arithmetic task: `trl_async.toy`); see `_compat`
    from . import _compat

    return _compat.moved_attribute(__name__, name)
