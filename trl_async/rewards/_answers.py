"""Answer semantics shared by the token-level [`MathAnswerReward`] and the text-level `math_answer_text_reward`.

One definition of "what counts as the final answer", used by both, so that the two agree by construction:

1. The *last* occurrence of an answer marker (`#### `, `\\boxed{`, `The answer is`; a letter-initial marker also
   matches with its first letter's case swapped; `####` does not match inside a longer run of `#`) selects the
   answer.
2. Right after that marker, the text must spell the gold answer: one of `separators` (`""`, `" "`, `":"`, `": "`),
   then one of the gold answer's surface forms ([`surface_forms`]: optional prefix `$`, `\\$` or `**`, sign,
   thousands separators, `.0`/`.00` on integers).
3. The character after the number must not continue it: not a digit, and not `.`/`,` followed by a digit (so 42
   does not match 42.5, 420 or 42,000; it matches `42.`, `42,` + text, `42}`, `42%`, `42 apples`).

Whatever follows (more text, other numbers) does not matter. A last marker with no matching number is wrong.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

DEFAULT_MARKERS: tuple[str, ...] = ("#### ", "\\boxed{", "The answer is")
DEFAULT_SEPARATORS: tuple[str, ...] = ("", " ", ":", ": ")
DEFAULT_PREFIXES: tuple[str, ...] = ("", "$", "\\$", "**")

_GOLD_NUMBER = re.compile(r"(-?)(?:\\?\$)?(-?)(\d*)(?:\.(\d*))?")
_CANONICAL_NUMBER = re.compile(r"(-?)(\d+)(?:\.(\d+))?")


def normalize_answer(answer: Any) -> str | None:
    """Canonical gold answer string, or `None` for a missing answer.

    - A GSM8K-style worked solution keeps only the part after its last `####`.
    - Numbers: commas (`1,000`, `1{,}000`), a `$`/`\\$` prefix, leading zeros, trailing decimal zeros and a trailing
      `.` are dropped (`"$1,000.00"` -> `"1000"`, `"-0.50"` -> `"-0.5"`, `".5"` -> `"0.5"`, `"-0"` -> `"0"`).
    - Anything else is kept verbatim (stripped): it must then appear literally after the marker.
    """
    if answer is None:
        return None
    if isinstance(answer, bool):
        answer = int(answer)
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    if not text:
        return None
    compact = text.replace("{,}", "").replace(",", "").replace(" ", "")
    m = _GOLD_NUMBER.fullmatch(compact)
    if m is None or not (m.group(3) or m.group(4)) or (m.group(1) and m.group(2)):
        return text
    negative = bool(m.group(1) or m.group(2))
    int_part = m.group(3).lstrip("0") or "0"
    frac = (m.group(4) or "").rstrip("0")
    body = int_part + ("." + frac if frac else "")
    return ("-" if negative and body != "0" else "") + body


def _group_thousands(digits: str, sep: str) -> str:
    head = len(digits) % 3 or 3
    parts = [digits[:head]] + [digits[i : i + 3] for i in range(head, len(digits), 3)]
    return sep.join(parts)


def number_parts(gold: str, prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The two independent halves of a canonical numeric gold answer's spellings, or `((), ())` for a non-numeric
    one: `(sign_prefixes, bodies)`, every surface form being `sign_prefix + body` (see [`surface_forms`]).

    - `sign_prefixes`: the prefixes (`""`, `$`, `\\$`, `**`), and for a negative answer a `-` before or after each.
    - `bodies`: the digits, with thousands separators (`1,000`, `1{,}000`) when `|n| >= 1000`, `.0`/`.00` on an
      integer, one trailing zero (`2.50`) or no leading zero (`.5`) on a decimal.
    """
    m = _CANONICAL_NUMBER.fullmatch(gold)
    if m is None:
        return (), ()
    negative, int_part, frac = m.group(1), m.group(2), m.group(3)
    ints = [int_part]
    if len(int_part) > 3:
        ints += [_group_thousands(int_part, ","), _group_thousands(int_part, "{,}")]
    if frac:
        decimals = ["." + frac, "." + frac + "0"]
        if int_part == "0":
            ints.append("")
    else:
        decimals = ["", ".0", ".00"]
    bodies = tuple(dict.fromkeys(i + d for i in ints for d in decimals if i + d))
    if negative:
        sign_prefixes = tuple(dict.fromkeys(s for cur in prefixes for s in (f"-{cur}", f"{cur}-")))
    else:
        sign_prefixes = tuple(dict.fromkeys(prefixes))
    return sign_prefixes, bodies


@functools.lru_cache(maxsize=65536)
def surface_forms(gold: str, prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> tuple[str, ...]:
    """Every accepted spelling of a canonical gold answer (without the separator after the marker).

    For an integer `n`: `n`, `n.0`, `n.00`, and with thousands separators `1,000` / `1{,}000` when `|n| >= 1000`;
    each with an optional prefix (currency `$`, `\\$`, or markdown bold `**`); a negative sign before or after the
    prefix (`-$5`, `$-5`).
    For a decimal `d`: `d` and `d` with one trailing zero (`2.5`, `2.50`; `0.5` also as `.5`). A non-numeric gold
    answer is its own only form."""
    sign_prefixes, bodies = number_parts(gold, prefixes)
    if not bodies:
        return (gold,)
    return tuple(dict.fromkeys(sp + body for sp in sign_prefixes for body in bodies))


def answer_suffixes(
    gold: str, separators: Sequence[str] = DEFAULT_SEPARATORS, prefixes: Sequence[str] = DEFAULT_PREFIXES
) -> tuple[str, ...]:
    """`separator + form` for every separator and surface form: what may follow the marker text."""
    forms = surface_forms(gold, tuple(prefixes))
    return tuple(dict.fromkeys(sep + form for sep in separators for form in forms))


def marker_spellings(marker: str) -> tuple[str, ...]:
    """The marker without trailing whitespace (the separators cover it), plus the first-letter case variant."""
    core = marker.rstrip()
    if not core:
        raise ValueError(f"an answer marker must contain a non-space character, got {marker!r}")
    spellings = [core]
    if core[0].isalpha() and core[0].swapcase() != core[0]:
        spellings.append(core[0].swapcase() + core[1:])
    return tuple(spellings)


# Text after a number that would continue it (see module docstring, rule 3).
NUMBER_CONTINUES = r"(?:[0-9]|[.,][0-9])"


def _run_guards(spelling: str) -> tuple[str, str]:
    """A marker that starts (ends) with a run of one punctuation character, like `####`, is not matched inside a
    longer run: tokenizers spell `#####` or `########` as single tokens that contain no `####` token."""
    before = after = ""
    if len(spelling) >= 2 and spelling[0] == spelling[1] and not spelling[0].isalnum():
        before = f"(?<!{re.escape(spelling[0])})"
    if len(spelling) >= 2 and spelling[-1] == spelling[-2] and not spelling[-1].isalnum():
        after = f"(?!{re.escape(spelling[-1])})"
    return before, after


def marker_regex(markers: Sequence[str]) -> re.Pattern[str]:
    """Regex finding every marker occurrence in text."""
    parts = set()
    for marker in markers:
        for spelling in marker_spellings(marker):
            before, after = _run_guards(spelling)
            parts.add(before + re.escape(spelling) + after)
    return re.compile("|".join(sorted(parts, key=len, reverse=True)))


@functools.lru_cache(maxsize=65536)
def answer_regex(gold: str, separators: tuple[str, ...], prefixes: tuple[str, ...]) -> re.Pattern[str]:
    """Regex that matches at the start of the text after a marker iff the text spells `gold` there (rules 2-3)."""
    seps = sorted(set(separators), key=len, reverse=True)
    forms = sorted(surface_forms(gold, prefixes), key=len, reverse=True)
    sep_re = "|".join(re.escape(s) for s in seps)
    form_re = "|".join(re.escape(f) for f in forms)
    return re.compile(f"(?:{sep_re})(?:{form_re})(?!{NUMBER_CONTINUES})")
