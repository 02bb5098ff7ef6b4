"""Tokenizer-side preparation shared by the tensor-native rewards (runs at construction / first sight, never in
`score`).

Byte-level BPE tokenizers (Qwen, Llama-3, GPT-2 style) merge a piece of text with its neighbours: `"\\boxed{42}"`
is `\\ boxed { 4 2 }`, but `"$\\boxed{-12}"` is `$\\ boxed {- 1 2`. A fixed string therefore has several token
spellings depending on what surrounds it. [`anchored_variants`] enumerates them by tokenizing the string between a
set of left contexts and right probes, with the tokenizer's character offsets:

- a token that straddles the left edge (`" The"`, `"$\\"`) is kept: it spells the first characters of the string
  together with its left neighbour, so matching it is matching the string in that context;
- the variant stops before the first token that would straddle the right edge (`"{-"` in `"\\boxed{-12}"`), and
  only the part that is the same for every right probe is kept, so the variant is context-free on the right.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .base import to_device

# Characters that typically precede an answer marker or a format tag in model output.
DEFAULT_LEFT_CONTEXTS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            "",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "$$",
            "**",
            "\\(",
            "\\[",
            ". ",
            ", ",
            ": ",
            "= ",
            " $",
            " (",
            " **",
            ".\n",
            ":\n",
        ]
        + ["*\n", "}\n", ")\n", "($", "=$", ":$", "**$", "x", "1"]
        + list(string.punctuation)
        + [" " + p for p in string.punctuation]
    )
)
# What may follow the string: digits, signs, currency, punctuation, words.
DEFAULT_RIGHT_PROBES: tuple[str, ...] = (
    "",
    " ",
    "\n",
    "x",
    " x",
    "X",
    "1",
    " 1",
    "-1",
    " -1",
    "$1",
    " $1",
    "\\$1",
    ":1",
    ": 1",
    ":$1",
    ".",
    ",",
    "}",
    "{",
    "{-",
    "**",
    " **",
    "\\",
    "(",
    "<",
)

# Chat/end-of-turn tokens treated as EOS by default when the tokenizer has them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def encode_with_offsets(tokenizer: Any, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids and character offsets for each text (no special tokens). Needs a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch"):  # skip the transformers wrapper: ~2x faster
        return [(e.ids, e.offsets) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    try:
        enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError) as err:  # slow tokenizers have no offset mapping
        raise ValueError(
            "The tensor-native rewards need a fast (Rust `tokenizers`) tokenizer with `return_offsets_mapping`; "
            f"{type(tokenizer).__name__} does not provide it."
        ) from err
    return [
        (list(ids), [tuple(o) for o in offs])
        for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]


def encode_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens), in one call of the Rust batch encoder when the tokenizer has one
    (`backend_tokenizer.encode_batch`, which skips the transformers wrapper)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def anchored_variants(
    tokenizer: Any,
    text: str,
    contexts: Iterable[str] = DEFAULT_LEFT_CONTEXTS,
    probes: Iterable[str] = DEFAULT_RIGHT_PROBES,
) -> list[tuple[tuple[int, ...], int | None, str]]:
    """Token spellings of `text` in context.

    For every left context and right probe, the tokens of `context + text + probe` that overlap `text` are read up to
    the first token that runs past the end of `text`. Returns sorted unique `(token_ids, end_char, context)`:

    - `end_char` is where the spelling stops inside `text` (a token boundary there): `text[end_char:]` is spelled
      together with whatever follows (`"\\boxed{"` followed by `-1` stops after `boxed`, because `{-` is one token);
    - `end_char` is `None` for a *closed* spelling, where `text` and the whitespace after it share a token
      (`"####\n"` is the single token `####\n`): the text is there, but nothing can follow it on the same line;
    - `context` is one left context that produces the spelling.

    A spelling longer (in tokens) than the longest one after the empty or the `" "` context keeps only its last
    tokens (`'T he answer is` -> `he answer is`).
    """
    if not text:
        raise ValueError("cannot build token variants of an empty string")
    contexts, probes = tuple(contexts), tuple(probes)
    encoded = encode_with_offsets(tokenizer, [c + text + p for c in contexts for p in probes])
    found: dict[tuple[tuple[int, ...], int | None], str] = {}
    for ci, ctx in enumerate(contexts):
        if ctx and ctx[-1] == text[0] and not text[0].isalnum():
            continue  # `#` + `####` is a longer run (`#####`), not the text after a `#`
        start, stop = len(ctx), len(ctx) + len(text)
        for pi, probe in enumerate(probes):
            ids, offs = encoded[ci * len(probes) + pi]
            seq: list[tuple[int, int, int]] = []
            closed = False
            for tid, (a, b) in zip(ids, offs, strict=True):
                if b <= start:
                    continue
                if a >= stop:
                    break
                if b > stop:
                    # `text` merges with the probe. Keep it as a closed spelling only when the probe part is
                    # whitespace (nothing can follow the text then); otherwise stop before this token.
                    if not probe[: b - stop].strip() and a < stop:
                        seq.append((tid, a, b))
                        closed = True
                    break
                seq.append((tid, a, b))
            if not seq or seq[0][1] > start:  # must cover the first character of `text`
                continue
            key = (tuple(t for t, _, _ in seq), None if closed else seq[-1][2] - start)
            found.setdefault(key, ctx)
    # The same tokens cannot spell two different amounts of `text`: that only happens when the context repeats the
    # text's first character (`#` + `####`); keep the spelling from the earliest (most common) context.
    by_tokens: dict[tuple[int, ...], tuple[tuple[tuple[int, ...], int | None], str]] = {}
    for key, ctx in found.items():
        if key[0] not in by_tokens or contexts.index(ctx) < contexts.index(by_tokens[key[0]][1]):
            by_tokens[key[0]] = (key, ctx)
    found = dict(by_tokens.values())
    # Exotic contexts can split the text into more tokens than it ever has on its own (`'The` -> `'T`, `he`);
    # keep only the last tokens of such a spelling, as many as the longest spelling without a left context (or
    # after a space) has. The kept part still ends where the spelling ends.
    plain = [len(ids) for (ids, _), ctx in found.items() if ctx in ("", " ")]
    if plain:
        trimmed: dict[tuple[tuple[int, ...], int | None], str] = {}
        for (ids, end), ctx in found.items():
            trimmed.setdefault((ids[-max(plain) :], end), ctx)
        found = trimmed
    return sorted(((ids, end, ctx) for (ids, end), ctx in found.items()), key=lambda v: (v[0], v[1] or -1, v[2]))


def tails_after(tokenizer: Any, pieces: Sequence[tuple[str, int, str]]) -> list[tuple[int, ...] | None]:
    """For each `(left_text, cut, suffix)`: the token ids of `left_text + suffix` that start at or after character
    `cut`, or `None` when a token straddles `cut` (the cut is not a token boundary there). One tokenizer call."""
    encoded = encode_with_offsets(tokenizer, [left + suffix for left, _, suffix in pieces])
    out: list[tuple[int, ...] | None] = []
    for (_, cut, _), (ids, offs) in zip(pieces, encoded, strict=True):
        if any(a < cut < b for a, b in offs):
            out.append(None)
        else:
            out.append(tuple(t for t, (a, _) in zip(ids, offs, strict=True) if a >= cut))
    return out


def default_eos_ids(tokenizer: Any) -> list[int]:
    """EOS ids used when none are given: the tokenizer's `eos_token_id` and `pad_token_id`, plus the usual
    end-of-turn tokens it knows (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...)."""
    ids: list[int] = []
    for attr in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(set(ids))


def normalize_eos(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    if isinstance(eos_token_id, str) or any(isinstance(e, str) for e in eos_token_id):
        raise TypeError(
            f"eos_token_id must be a token id (int) or a list of ids, got {eos_token_id!r}: a token's id is "
            "`tokenizer.convert_tokens_to_ids(token)` (or `tokenizer.eos_token_id`)."
        )
    out = sorted({int(e) for e in eos_token_id})
    if any(e < 0 for e in out):
        raise ValueError(f"EOS token ids must be non-negative, got {out}")
    return out


_DIGIT_START = re.compile(r"[0-9]")
_SEP_DIGIT_START = re.compile(r"[.,][0-9]")


def number_classes(tokenizer: Any) -> list[int]:
    """Per token id (plus one sentinel slot at the end), how the token relates to a number it follows:
    3 = starts with an ASCII digit; 2 = starts with `.`/`,` and a digit (`.5` in some vocabularies); 1 = exactly `.`
    or `,` (continues a number only if the next token starts with a digit); 0 = anything else.

    A token of class `a` followed by one of class `b` continues the number iff `4 * a + b >= 7`.
    Uses the raw vocabulary strings: in byte-level BPE and SentencePiece vocabularies a leading space is a marker
    character (`Ġ`, `▁`), so a token that *starts* with a digit has no space before the digit."""
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    classes = [0] * (size + 1)
    for i, tok in enumerate(tokens):
        if not tok:
            continue
        if _DIGIT_START.match(tok):
            classes[i] = 3
        elif _SEP_DIGIT_START.match(tok):
            classes[i] = 2
        elif tok in (".", ","):
            classes[i] = 1
    return classes


def reduce_alphabet(variants: Sequence[tuple[tuple[int, ...], int]]) -> dict[int, int]:
    """Codes 1..U for the tokens of `variants` (`(token_ids, item)` pairs), interchangeable tokens sharing a code.

    Two tokens are interchangeable when swapping one for the other anywhere maps the variant set onto itself (same
    items): e.g. `$\\`, `(\\` and ` \\` before `boxed`. Matching codes instead of tokens is then exact, and the
    smaller alphabet keeps the lookup tables small (and in cache)."""
    signature: dict[int, set] = {}
    for toks, item in variants:
        for p, t in enumerate(toks):
            signature.setdefault(t, set()).add((toks[:p], toks[p + 1 :], item))
    groups: dict[frozenset, int] = {}
    code_of = {}
    for t in sorted(signature):
        code_of[t] = groups.setdefault(frozenset(signature[t]), len(groups) + 1)
    return code_of


class SuffixTable:
    """Find which of several token-sequence sets end at each position, with table lookups only.

    `variants` are `(token_ids, item)` pairs (several spellings may belong to one item). Every token of a variant
    gets a code ([`reduce_alphabet`]; 0 = any other token); the codes of the last `km` tokens at each position form
    one base-(U+1) integer (`km - 1` shifted adds). When `(U+1)**km` is small that integer indexes a table holding,
    per item, the length of the shortest variant of that item ending at the position (0: none); otherwise (long
    spellings, e.g. a small vocabulary spelling `<think>` letter by letter) sorted per-length encodings are searched
    with `searchsorted`.
    """

    def __init__(self, variants: Sequence[tuple[tuple[int, ...], int]], n_items: int, max_entries: int = 2**22):
        if not variants:
            raise ValueError("no token variants to match")
        if n_items > 62:
            raise ValueError("at most 62 items")
        code_of = reduce_alphabet(variants)
        tokens = sorted(code_of)
        base = max(code_of.values()) + 1
        km = max(len(toks) for toks, _ in variants)
        if base**km >= 2**62:
            raise ValueError(f"token variants too long for exact matching ({base - 1} codes, {km} long)")
        self.n_items, self.km, self.base = n_items, km, base
        self.sentinel = tokens[-1] + 1  # ids above the largest variant token map here (code 0)
        self.code = torch.zeros(self.sentinel + 1, dtype=torch.long)
        self.code[torch.tensor(tokens, dtype=torch.long)] = torch.tensor([code_of[t] for t in tokens])
        encoded = [
            (len(t), sum(code_of[t[len(t) - 1 - j]] * base**j for j in range(len(t))), item) for t, item in variants
        ]
        self.lut, self.by_length = None, []
        if base**km * n_items <= max_entries:
            lut = torch.zeros(base**km, n_items, dtype=torch.long)
            for k, enc, item in encoded:
                view = lut[enc :: base**k, item]  # every window whose last k codes spell this variant
                view.copy_(torch.where((view == 0) | (view > k), k, view))
            self.lut = lut.to(torch.int16 if km < 2**15 else torch.long)
        else:
            for length in sorted({k for k, _, _ in encoded}):
                bits: dict[int, int] = {}
                for k, enc, item in encoded:
                    if k == length:
                        bits[enc] = bits.get(enc, 0) | (1 << item)
                encs = sorted(bits)
                self.by_length.append((length, torch.tensor(encs), torch.tensor([bits[e] for e in encs])))
        self._device_cache: dict = {}

    def to(self, device: torch.device) -> tuple:
        cached = self._device_cache.get(device)
        if cached is None:
            lut = None if self.lut is None else to_device(self.lut, device)
            by_length = [(k, to_device(e, device), to_device(b, device)) for k, e, b in self.by_length]
            cached = self._device_cache[device] = (to_device(self.code, device), lut, by_length)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_device_cache"] = {}
        return state

    def lookup(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`(B, L, n_items)`: length of the shortest variant of each item ending at each position (0: none).
        Positions where `valid` is False never take part in a match."""
        code, lut, by_length = self.to(ids.device)
        length = ids.shape[1]
        c = torch.where(valid, code[ids.clamp(min=0, max=self.sentinel)], 0)
        if self.km > 1:
            padded = F.pad(c, (self.km - 1, 0))
            c = padded[:, self.km - 1 :]
            for j in range(1, self.km):
                c = torch.add(c, padded[:, self.km - 1 - j : self.km - 1 - j + length], alpha=self.base**j)
        if lut is not None:
            return lut[c]
        out = torch.zeros(*c.shape, self.n_items, dtype=torch.long, device=c.device)
        for k, encs, bits in by_length:  # ascending k: keep the shortest variant of each item
            suffix = c % self.base**k if k < self.km else c  # codes of the last k tokens
            at = torch.searchsorted(encs, suffix).clamp_(max=encs.numel() - 1)
            found = torch.where(encs[at] == suffix, bits[at], 0)
            for item in range(self.n_items):
                new = ((found >> item) & 1).bool() & (out[..., item] == 0)
                out[..., item] = torch.where(new, k, out[..., item])
        return out
