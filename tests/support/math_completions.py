"""Synthetic GSM8K-style completions with known labels, for the reward tests and benchmarks.

Each sample is a completion text (what the model wrote before its EOS), an optional text emitted *after* the EOS
(chat-template tails, runaway generation), the gold answer as a dataset would store it, the label under the
semantics of `_answers.py` (written here by hand per category, not computed by the reward), and a category name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Randy", "Joy"]
ITEMS = ["clips", "apples", "pages", "cookies", "marbles", "stickers", "books", "pencils", "eggs", "cupcakes"]
OPENERS = ["Let's think step by step.", "Let me work through this.", "We solve it step by step.", ""]


@dataclass
class Sample:
    text: str  # completion text before the EOS
    answer: str  # gold answer as stored in the dataset column
    label: float  # 1.0 correct, 0.0 wrong
    category: str
    after_eos: str = ""  # tokens the model emitted after its EOS (must be ignored)


def reasoning(rng: random.Random, steps: int | None = None, include: int | None = None) -> str:
    """A few lines of GSM8K-like arithmetic. `include` puts that number in the text (a trap for sloppy matchers)."""
    steps = rng.randint(1, 4) if steps is None else steps
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    lines = [rng.choice(OPENERS)] if rng.random() < 0.7 else []
    x = rng.randint(2, 60)
    lines.append(f"{name} starts with {x} {item}.")
    for _ in range(steps):
        kind = rng.randrange(4)
        if kind == 0:
            b = rng.randint(1, 40)
            lines.append(f"Then {name} gets {b} more, so there are {x} + {b} = {x + b} {item}.")
            x += b
        elif kind == 1:
            m = rng.randint(2, 6)
            lines.append(f"Each box holds {m} times as many, so {x} * {m} = {x * m} {item} in total.")
            x *= m
        elif kind == 2 and x > 3:
            c = rng.randint(1, x - 1)
            lines.append(f"{name} gives away {c}, leaving {x} - {c} = {x - c}.")
            x -= c
        else:
            p = rng.randint(2, 12)
            lines.append(f"At ${p} each, that costs {x} * {p} = ${x * p}.")
    if include is not None:
        lines.append(f"Note that {include} is part of the calculation.")
    sep = "\n" if rng.random() < 0.5 else " "
    return sep.join(line for line in lines if line)


def _near_misses(g: int) -> list[str]:
    s = str(g)
    out = [f"1{s}", f"{s}0", f"{s}.5", f"{s}5", f"-{s}", f"{s},000"]
    if len(s) >= 2:
        out.append(f"{s[:-1]}.{s[-1]}")  # 42 -> 4.2
    return out


def make_samples(n_per_category: int = 150, seed: int = 0) -> list[Sample]:
    """Realistic completions with hand-assigned labels, `n_per_category` per category (17 categories)."""
    rng = random.Random(seed)
    samples: list[Sample] = []

    def gold() -> int:
        return rng.choice([rng.randint(2, 99), rng.randint(100, 999), rng.randint(2, 400)])

    def wrong(g: int) -> int:
        w = g + rng.choice([-1, 1]) * rng.randint(1, 30)
        return w if w != g and w > 0 else g + 7

    def add(category: str, text: str, answer: object, label: float, after_eos: str = "") -> None:
        samples.append(Sample(text, str(answer), label, category, after_eos))

    for _ in range(n_per_category):
        g = gold()
        r = reasoning(rng, include=g if rng.random() < 0.3 else None)
        add("hash_correct", f"{r}\n#### {g}", g, 1.0)

        g = gold()
        fmt = rng.choice(
            [
                "The final answer is $\\boxed{%s}$.",
                "\\boxed{%s}",
                "So the total is \\boxed{%s}.",
                "**Answer:** $\\boxed{%s}$",
                "Therefore, the answer is \\(\\boxed{%s}\\).",
            ]
        )
        add("boxed_correct", f"{reasoning(rng)}\n{fmt % g}", g, 1.0)

        g = gold()
        fmt = rng.choice(
            ["The answer is %s.", "So the answer is %s %s.", "The answer is: %s", "Thus the answer is %s"]
        )
        text = fmt % ((g, rng.choice(ITEMS)) if fmt.count("%s") == 2 else g)
        add("answer_is_correct", f"{reasoning(rng)} {text}", g, 1.0)

        g = gold()
        w = wrong(g)
        marker = rng.choice(["#### %s", "\\boxed{%s}", "The answer is %s."])
        add("wrong_value", f"{reasoning(rng, include=g)}\n{marker % w}", g, 0.0)

        g = gold()
        miss = rng.choice(_near_misses(g))
        marker = rng.choice(["#### %s", "$\\boxed{%s}$", "The answer is %s."])
        add("near_miss", f"{reasoning(rng, include=g)}\n{marker % miss}", g, 0.0)

        g = gold()
        case = rng.randrange(4)
        if case == 0:
            add("negative", f"{reasoning(rng)}\n\\boxed{{-{g}}}", -g, 1.0)
        elif case == 1:
            add("negative", f"{reasoning(rng)}\n#### -{g}", f"-{g}", 1.0)
        elif case == 2:
            add("negative", f"{reasoning(rng)}\n#### {g}", -g, 0.0)
        else:
            add("negative", f"{reasoning(rng)}\n\\boxed{{-{g}}}", g, 0.0)

        g = rng.randint(1000, 250000)
        grouped = f"{g:,}"
        case = rng.randrange(5)
        if case == 0:
            add("commas", f"{reasoning(rng)}\n#### {grouped}", g, 1.0)
        elif case == 1:
            add("commas", f"{reasoning(rng)}\n#### {g}", grouped, 1.0)
        elif case == 2:
            add("commas", f"{reasoning(rng)}\nThe answer is {grouped} {rng.choice(ITEMS)}.", grouped, 1.0)
        elif case == 3:
            add("commas", f"{reasoning(rng)}\n$\\boxed{{{grouped.replace(',', '{,}')}}}$", g, 1.0)
        else:
            add("commas", f"{reasoning(rng)}\n#### {grouped}", str(g)[-3:].lstrip("0") or "0", 0.0)

        g = gold()
        fmt = rng.choice(["#### $%s", "The answer is $%s.", "The answer is $%s$.", "\\boxed{\\$%s}", "#### -$%s"])
        if fmt.endswith("-$%s"):
            add("dollar", f"{reasoning(rng)}\n{fmt % g}", f"-{g}", 1.0)
        else:
            add("dollar", f"{reasoning(rng)}\n{fmt % g}", g if rng.random() < 0.8 else f"${g}", 1.0)

        g = gold()
        case = rng.randrange(6)
        if case == 0:
            add("decimal_zero", f"{reasoning(rng)}\n#### {g}.0", g, 1.0)
        elif case == 1:
            add("decimal_zero", f"{reasoning(rng)}\nThe answer is {g}.00 dollars.", g, 1.0)
        elif case == 2:
            add("decimal_zero", f"{reasoning(rng)}\n#### {g}", f"{g}.0", 1.0)
        elif case == 3:
            add("decimal_zero", f"{reasoning(rng)}\n#### {g}.05", g, 0.0)
        elif case == 4:
            d = f"{g}.{rng.randint(1, 9)}"
            add("decimal_zero", f"{reasoning(rng)}\n\\boxed{{{d}}}", d, 1.0)
        else:
            d = f"{g}.{rng.randint(1, 9)}"
            add("decimal_zero", f"{reasoning(rng)}\n\\boxed{{{d}}}", g, 0.0)

        g = gold()
        tail = rng.choice(
            [
                f"\n\nThis is {rng.randint(2, 50)} more than {rng.randint(2, 50)}.",
                f" (since {rng.randint(2, 9)} + {rng.randint(2, 9)} = {rng.randint(10, 18)})",
                f"\nCheck: {g} - {rng.randint(1, 9)} is smaller, and 3 * 4 = 12.",
                " apples in total. Step 2 was the key, 5 times 6 is 30.",
            ]
        )
        marker = rng.choice(["#### %s", "\\boxed{%s}", "The answer is %s"])
        add("trailing_text", f"{reasoning(rng)}\n{marker % g}{tail}", g, 1.0)

        g = gold()
        w = wrong(g)
        if rng.random() < 0.5:
            add(
                "overridden",
                f"{reasoning(rng)} The answer is {w}. Wait, let me recheck.\n{reasoning(rng)}\n#### {g}",
                g,
                1.0,
            )
        else:
            add("overridden", f"{reasoning(rng)} The answer is {g}. Hmm, that is off.\n\\boxed{{{w}}}", g, 0.0)

        g = gold()
        end = rng.choice(
            [
                "\n#### ",
                "\nThe answer is unclear.",
                "\n\\boxed{}",
                "\n#### The total.",
                f" The answer is {g}.\nThe answer is",
                f"\n#### {g}\nSo the answer is twice as big.",
            ]
        )
        add("marker_no_number", f"{reasoning(rng, include=g)}{end}", g, 0.0)

        g = gold()
        w = wrong(g)
        case = rng.randrange(4)
        if case == 0:
            add("chat_tail", f"{reasoning(rng)}\n#### {g}", g, 1.0, after_eos="\n<|endoftext|>")
        elif case == 1:
            add("chat_tail", f"{reasoning(rng)}\n#### {w}", g, 0.0, after_eos=f"\n#### {g}")
        elif case == 2:
            add("chat_tail", f"{reasoning(rng)}\n#### {g}", g, 1.0, after_eos=f"<|im_start|>user\n#### {w}")
        else:
            add("chat_tail", f"{reasoning(rng)}\nThe answer is {g}.", g, 1.0, after_eos="<|endoftext|><|endoftext|>")

        g = gold()
        add("no_marker", f"{reasoning(rng)}\nSo in total there are {g} {rng.choice(ITEMS)}.", g, 0.0)

        g = gold()
        fmt = rng.choice(["So the answer is %s.", "the answer is %s", "Final: the answer is **%s**"])
        add("lowercase_and_markdown", f"{reasoning(rng)} {fmt % g}", g, 1.0)

        g = gold()
        fmt = rng.choice(
            [
                "(The answer is %s.)",
                "**The answer is %s.**",
                "> The answer is %s",
                '"The answer is %s"',
                "...The answer is %s",
                "x =\\boxed{%s}",
                "($\\boxed{%s}$)",
                "\\[\\boxed{%s}\\]",
                "#### %s</answer>",
                "Answer:\n#### %s",
                "'The answer is %s'",
                "**#### %s**",
                "<answer>\\boxed{%s}</answer>",
                "The answer is\t%s",
                "=$\\boxed{%s}$",
            ]
        )
        label = 0.0 if "\t" in fmt else 1.0  # a tab is not a separator
        add("unusual_context", f"{reasoning(rng)}\n{fmt % g}", g, label)

        g = gold()
        fmt = rng.choice(["####%s", "#### %s", "The answer is:%s", "The answer is: $%s", "\\boxed{ %s }"])
        add("spacing", f"{reasoning(rng)}\n{fmt % g}", g, 1.0)
    return samples


def padded_batch(
    samples, tokenizer, eos_token_id: int, pad_token_id: int, length: int | None = None, mask_after_eos: bool = True
):
    """Token ids `(B, L)` and mask for samples: `text` ids, EOS, `after_eos` ids, padding. With `mask_after_eos`,
    the mask stops after the EOS (TRL's mask); otherwise it also covers the after-EOS tokens (so only EOS handling
    can ignore them)."""
    import torch

    rows, masks = [], []
    for s in samples:
        ids = tokenizer.encode(s.text, add_special_tokens=False) + [eos_token_id]
        n_mask = len(ids)
        ids += tokenizer.encode(s.after_eos, add_special_tokens=False) if s.after_eos else []
        if not mask_after_eos:
            n_mask = len(ids)
        rows.append(ids)
        masks.append(n_mask)
    width = length or max(len(r) for r in rows)
    ids_t = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask_t = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        r = r[:width]
        ids_t[i, : len(r)] = torch.tensor(r)
        mask_t[i, : min(m, width)] = 1
    return ids_t, mask_t


def long_completion(rng: random.Random, tokenizer, target_tokens: int, answer_text: str) -> str:
    """Reasoning text grown until it is about `target_tokens` long (Qwen tokens), ending with `answer_text`."""
    tail_len = len(tokenizer.encode("\n" + answer_text, add_special_tokens=False))
    parts: list[str] = []
    total = 0
    while True:
        chunk = reasoning(rng)
        n = len(tokenizer.encode(" " + chunk, add_special_tokens=False))
        if total + n + tail_len > target_tokens and parts:
            break
        parts.append(chunk)
        total += n
        if total + tail_len >= target_tokens:
            break
    return " ".join(parts) + "\n" + answer_text
