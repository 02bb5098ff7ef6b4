"""`MathAnswerReward`: exact-match math answers on token ids, vectorized over the batch.

Per call, everything is tensor ops on the ids' device: no decode, no tokenizer, no `.item()`, no Python loop over
rows or tokens (the only per-row Python work is the dict lookup from each row's gold answer to its cached table row,
which the list-valued dataset column forces).

1. **Padded ids.** The ids are written into a reused `(B, km + L + W)` buffer between sentinel padding (ids out of
   range read as the sentinel; positions outside `completion_mask` as a "masked" id that acts as an EOS). Flattened,
   the padding also keeps the rows apart, so the next steps run on the flat buffer without per-row views.
2. **One lookup per token.** A table over the vocabulary gives each token a small code: tokens of marker spellings
   get codes 1..U (interchangeable tokens share one, `_tokens.reduce_alphabet`), EOS ids and the masked id U+1,
   all others 0.
3. **Markers and the valid region in one running sum.** At construction each marker (`#### `, `\\boxed{`,
   `The answer is`) is turned into its token spellings in context (`_tokens.anchored_variants`: `\\boxed` is
   `\\ boxed`, `$\\ boxed`, ` \\ boxed`, ...). The codes of the last `km + 1` tokens at a position form one
   base-(U+2) integer (2 doubling adds for km = 3). It indexes a table of *steps*: `step - BIG * (the token is a
   stop) + cv(last km tokens) - cv(the km tokens before)`, where cv is `OFF + class` where a marker ends and 0
   elsewhere. One `cumsum` telescopes the steps to `position * step - BIG * (stops so far) + cv`: at least `OFF`
   exactly where a marker ends before the first stop, and one `amax` finds the last such marker and its class.
4. **Answer window.** The `W` tokens after the last marker are gathered (`W` = longest answer spelling + 3). Tokens
   after the first stop need no masking: the stop (EOS or masked) is in no spelling and ends every number. Each
   token's feature is `4 * alphabet code + number class` (one lookup): the answer alphabet holds the tokens that
   occur in any cached spelling (code 1 = anything else), the number class says whether the token continues a
   number (`_tokens.number_classes`). Prefix keys are one `cumsum` of `feature_j * key_j` with fixed random
   43-bit `key_j` (no int64 overflow).
5. **Gold spellings.** Each gold answer is prepared once, by `prepare` ahead of scoring (the generation process
   calls it through `prepare_rewards`) or on first sight inside `score`: every accepted spelling of it after each
   marker (separator, prefix `$`/`\\$`/`**`, sign placement, thousands separators, `.0`/`.00`;
   `_answers.surface_forms`), tokenized as a model produces it after the marker text (merges such as `{-` in
   `\\boxed{-12}`, ` -$` or `:$` included), is stored as its key in the row (gold answer, marker class) of a sorted
   table. For numeric answers the tokens of the part before the first digit are cached per marker at construction
   and only the numbers are tokenized, in one batched call for all new answers (`_build_number_heads`); other
   answers, and tokenizers where that composition is not exact, tokenize every spelling with its marker.
6. **Match.** `searchsorted` looks every prefix key up in the row's sorted keys; a hit at a prefix length where the
   next token does not continue the number (not a digit, not `.`/`,` + digit) scores 1.

About 30 tensor ops per call (the ops run under `torch.inference_mode`; the returned tensor is an ordinary one).
Keys make the lookup one `searchsorted`; two different spellings share a key with probability about 2^-43 per
comparison (a window has < 64 prefixes, a row a few hundred spellings: ~3e-10 per completion).

Small vocabularies that spell a marker in many tokens (the step table would be too large) locate the last marker
with per-length sorted encodings and `searchsorted` instead of step 3; steps 4-6 are the same.

The marker search (its tables, built at construction, and `_last_marker`) and the tensors kept per device and batch
shape (`_DeviceState`, `_Workspace`) live in `_answer_matching.py`; this file builds the gold-answer tables and runs
the match.

Marker classes: spellings that stop at different places (`\\boxed` before a merged `{-`, `\\boxed{` before a
digit) or belong to markers followed by different answer spellings get different classes; markers that behave alike
(`####` and `The answer is`, both followed by `" " + number`) share one. A *closed* spelling (the marker merged with
a newline, `####\\n`) is a class with no answers: it still counts as the last marker.

Tokenization assumptions: digits are not merged with the punctuation that *follows* the number (true for byte-level
BPE tokenizers with GPT-2/Llama-3/Qwen pre-tokenizers; tested on Qwen), and the model spells the answer the way the
tokenizer would (a non-canonical tokenization of `42` is not matched).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ._answer_matching import _build_marker_tables, _DeviceState, _last_marker
from ._answers import (
    DEFAULT_MARKERS,
    DEFAULT_PREFIXES,
    DEFAULT_SEPARATORS,
    answer_suffixes,
    marker_spellings,
    normalize_answer,
    number_parts,
)
from ._tokens import (
    DEFAULT_LEFT_CONTEXTS,
    anchored_variants,
    default_eos_ids,
    encode_ids,
    encode_with_offsets,
    normalize_eos,
    number_classes,
    tails_after,
)
from .base import TensorReward, check_tokenizer_argument, pad_completion_ids, to_device

__all__ = ["MathAnswerReward"]

_MAX_WINDOW = 64  # longest answer spelling (in tokens) + 2
_MAX_CODES = 2**12  # answer-alphabet codes
_KEY_BITS = 43  # window features < 4 * 2**12, keys < 2**43, at most 62 terms: sums < 2**63
_GOLD_CHUNK = 512  # new gold answers added per batch of tensor ops (larger batches leave the CPU caches)
_SEED = 0x5EED_A115
_KEY_PAD = torch.iinfo(torch.int64).max  # table padding: larger than any key, equal to none
_PROBE_GOLDS = ("42", "-1234.5", "1000000", "0.25", "-7", "905", "3")
# More probes for the composition check (`_build_number_heads`): every sign and lead, long numbers, zeros.
_STRUCTURE_PROBES = ("-0.5", "0.5", "-12.75", "1000.5", "10", "-20000", "7000000.25", "0", "98765432109876543210")


def _as_set(spellings: tuple[torch.Tensor, ...]) -> set[tuple[int, ...]]:
    return set(zip(*(t.tolist() for t in spellings), strict=True))


class MathAnswerReward(TensorReward):
    """1.0 when the completion's final answer equals the gold answer, else 0.0 (NaN when the gold is missing).

    Args:
        tokenizer: the policy's fast tokenizer. Used at construction and on the first sight of each gold answer
            (`prepare()` does that ahead of time), never while scoring seen answers.
        answer_column: dataset column holding the gold answers (strings or numbers; a GSM8K worked solution is cut
            after its last `####`; `None` scores NaN, TRL's "does not apply").
        markers: answer markers; the last one in the completion decides. A trailing space in a marker is optional
            (the separators cover it); a letter-initial marker also matches with its first letter's case swapped.
        eos_token_id: id(s) that end the completion; default: the tokenizer's eos/pad ids and known end-of-turn
            tokens (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...).
        separators: what may sit between a marker and the number (default `""`, `" "`, `":"`, `": "`).
        prefixes: accepted number prefixes (default none, `$`, `\\$`, `**`).
        left_contexts: left contexts used to enumerate marker spellings (`_tokens.DEFAULT_LEFT_CONTEXTS`).
        name: logged name (default `"math_answer_reward"`).

    Semantics are those of `math_answer_text_reward` on decoded text (`trl_async/rewards/_answers.py`): the last
    marker must be followed by the gold answer with a number boundary after it; text after that is ignored;
    `1,000` == `1000`, `$42` == `**42**` == `42`, `12.0` == `12`, negatives with the sign before or after a prefix.
    """

    _device_caches = ("_device_cache",)

    def __init__(
        self,
        tokenizer: Any,
        answer_column: str = "answer",
        markers: Sequence[str] = DEFAULT_MARKERS,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        separators: Sequence[str] = DEFAULT_SEPARATORS,
        prefixes: Sequence[str] = DEFAULT_PREFIXES,
        left_contexts: Sequence[str] = DEFAULT_LEFT_CONTEXTS,
        name: str | None = None,
    ):
        super().__init__(name=name)
        check_tokenizer_argument(tokenizer, "MathAnswerReward")
        if not isinstance(answer_column, str):
            raise TypeError(f"MathAnswerReward answer_column must be a column name (str), got {answer_column!r}.")
        if isinstance(markers, str):
            markers = (markers,)
        if not markers:
            raise ValueError("MathAnswerReward needs at least one answer marker")
        self.tokenizer = tokenizer
        self.answer_column = answer_column
        self.markers = tuple(markers)
        self.separators = tuple(separators)
        self.prefixes = tuple(prefixes)
        self.vocab_size = len(tokenizer)
        self.sentinel = self.vocab_size  # "no token here": padding, after the completion, outside the window
        self.eos_token_ids = default_eos_ids(tokenizer) if eos_token_id is None else normalize_eos(eos_token_id)
        self._head_cache: dict[tuple[int, str], tuple[int, ...] | None] = {}
        self._body_cache: dict[str, tuple[int, ...]] = {}
        self._build_markers(tuple(left_contexts))
        # Window token features, per vocabulary id (+ the sentinel and the "masked" id): 4 * answer-alphabet code +
        # number class (see `number_classes`). Tokens that occur in some cached answer spelling get alphabet codes
        # from 2 (1 = any other token, or "past the completion"); the alphabet grows as new gold answers bring new
        # tokens.
        self._number_class = torch.tensor(number_classes(tokenizer) + [0], dtype=torch.int16)
        self._feat = self._number_class + 4
        self._alphabet: dict[int, int] = {}
        self._keys = torch.randint(1, 2**_KEY_BITS, (_MAX_WINDOW,), generator=torch.Generator().manual_seed(_SEED))
        # Gold-answer cache: gold answer g, marker class c -> table row g * (C + 1) + c, holding the sorted keys of
        # the spellings of g after a marker of class c (c = 0, "no marker", stays empty). Gold 0 means "no gold
        # answer" (empty rows; scored NaN). `_index` maps a raw answer value to its first row g * (C + 1).
        self._index: dict[Hashable, int] = {}
        self._gold_rows: dict[str | None, int] = {None: 0}
        self._stride = self._n_classes + 1
        self._class_mask = (1 << self._class_bits) - 1
        self._table = torch.full((64 * self._stride, 8), _KEY_PAD, dtype=torch.long)
        self._n_rows = 1
        self._max_len = 1
        self._version = 0
        self._device_cache: dict[torch.device, _DeviceState] = {}
        # Guards the gold-answer cache: `prepare` may run in another thread (for the next batch while this one is
        # generated) while `score` reads the tables.
        self._lock = threading.RLock()
        self._structured = self._build_number_heads()

    # ------------------------------------------------------------------ construction
    def _build_markers(self, contexts: tuple[str, ...]) -> None:
        # A marker "kind" is (marker index, where its spelling stops inside the marker text), with the text the
        # answer spellings are tokenized after; `None` for closed spellings (`####\n`), which take no answer.
        kinds: dict[tuple[int, int | None], tuple[str, int] | None] = {}
        variants: list[tuple[tuple[int, ...], int]] = []
        for mi, marker in enumerate(self.markers):
            for spelling in marker_spellings(marker):
                for toks, end, ctx in anchored_variants(self.tokenizer, spelling, contexts):
                    key = (mi, end)
                    if key not in kinds:
                        kinds[key] = None if end is None else (ctx + spelling, len(ctx) + end)
                    variants.append((toks, list(kinds).index(key)))
        self._kind_prefixes = list(kinds.values())
        self._composable = self._check_composable()

        # Marker classes: kinds with identical answer spellings (on probe answers) share a class (ids from 1).
        signatures: dict[Any, int] = {}
        kind_class: list[int] = []
        probes = self._spellings_by_kind(list(_PROBE_GOLDS))
        for kind, prefix in enumerate(self._kind_prefixes):
            sig = ("closed", kind) if prefix is None else tuple(frozenset(p[kind]) for p in probes)
            kind_class.append(signatures.setdefault(sig, len(signatures) + 1))
        self._kind_class = kind_class
        self._n_classes = len(signatures)

        # The code of every token and the lookup of a marker's class by the codes of its tokens
        # (`_answer_matching._build_marker_tables`).
        variants = [(toks, kind_class[kind]) for toks, kind in variants if not set(toks) & set(self.eos_token_ids)]
        tables = _build_marker_tables(variants, self._n_classes, self.vocab_size, self.eos_token_ids, self.sentinel)
        self._code, self._eos_code, self._base, self._km = tables.code, tables.eos_code, tables.base, tables.km
        self._class_bits = tables.class_bits
        self._marker_variants = variants
        self._class_lut, self._step_lut = tables.class_lut, tables.step_lut
        self._class_by_length = tables.class_by_length

    def _split_suffixes(self, gold: str) -> list[tuple[str, str]]:
        out = []
        for suffix in answer_suffixes(gold, self.separators, self.prefixes):
            cut = next((i for i, ch in enumerate(suffix) if ch.isdigit()), len(suffix))
            out.append((suffix[:cut], suffix[cut:]))
        return out

    def _spellings_by_kind(self, golds: Sequence[str | None], compose: bool | None = None) -> list[list[set]]:
        """For each gold answer and each marker kind: the set of token spellings of the answer after the marker."""
        open_kinds = [k for k, p in enumerate(self._kind_prefixes) if p is not None]
        pieces: list[tuple[int, int, str, str]] = []  # (gold index, kind, head, body)
        for gi, gold in enumerate(golds):
            if gold is not None:
                pieces += [(gi, k, head, body) for head, body in self._split_suffixes(gold) for k in open_kinds]
        out: list[list[set]] = [[set() for _ in self._kind_prefixes] for _ in golds]
        for (gi, kind, _, _), tail in zip(pieces, self._tails(pieces, compose), strict=True):
            if tail and len(tail) <= _MAX_WINDOW - 2:
                out[gi][kind].add(tail)
        return out

    def _tails(self, pieces: Sequence[tuple[int, int, str, str]], compose: bool | None = None) -> list:
        """Token ids after the marker cut of `marker text + head + body`, for each piece (`None`: no boundary).

        Tokenizing every spelling of every answer jointly with every marker is the slow part of first sight (a few
        hundred strings per answer). When the tokenizer starts a token at every digit and tokenizes a number
        independently of what precedes it (checked at construction on probe answers), a spelling is composed from
        a cached answer-independent *head* (marker end + separator + prefix + sign) and the tokens of the *body*
        (the number); otherwise it is tokenized whole.
        """
        compose = self._composable if compose is None else compose
        out: list = [None] * len(pieces)
        whole: list[int] = []
        if compose:
            heads = sorted({(k, h) for _, k, h, b in pieces if b and (k, h) not in self._head_cache})
            if heads:
                got = tails_after(self.tokenizer, [(*self._kind_prefixes[k], h + "0") for k, h in heads])
                for key, toks in zip(heads, got, strict=True):
                    self._head_cache[key] = toks[:-1] if toks and toks[-1] == self._zero_id else None
            bodies = sorted({b for _, _, _, b in pieces if b and b not in self._body_cache})
            if bodies:
                for body, (ids, _) in zip(bodies, encode_with_offsets(self.tokenizer, bodies), strict=True):
                    self._body_cache[body] = tuple(ids)
            for i, (_, k, h, b) in enumerate(pieces):
                head = self._head_cache.get((k, h)) if b else None
                if head is None:
                    whole.append(i)
                else:
                    out[i] = head + self._body_cache[b]
        else:
            whole = list(range(len(pieces)))
        if whole:
            got = tails_after(
                self.tokenizer, [(*self._kind_prefixes[pieces[i][1]], pieces[i][2] + pieces[i][3]) for i in whole]
            )
            for i, toks in zip(whole, got, strict=True):
                out[i] = toks
        return out

    def _check_composable(self) -> bool:
        zero = encode_with_offsets(self.tokenizer, ["0"])[0][0]
        if len(zero) != 1:
            return False
        self._zero_id = zero[0]
        open_kinds = [k for k, p in enumerate(self._kind_prefixes) if p is not None]
        pieces = [(0, k, h, b) for gold in _PROBE_GOLDS for h, b in self._split_suffixes(gold) for k in open_kinds]
        return self._tails(pieces, compose=True) == self._tails(pieces, compose=False)

    # ------------------------------------------------------------------ numeric answers: composed spellings
    def _build_number_heads(self) -> bool:
        """Tokenize, once, everything that can sit between a marker and a numeric answer's first digit; return
        whether new numeric answers can be added by composition (the fast path of `_add_golds`).

        A numeric answer's spelling after a marker is `separator + sign/prefix + body` (`_answers.number_parts`). Cut
        at its first digit, it is a *head* that does not depend on the answer (separator, sign, prefix, and the `.`
        of `.5`) and the rest of the body. With a tokenizer that starts a new token at a number's first digit and
        tokenizes the number the same whatever precedes it (a pre-tokenizer that splits digits off, as Qwen's), the
        spelling's tokens are `head tokens + body tokens`, and since a key is a position-weighted sum (`_hash_many`),
        `key(spelling) = key(head) + key(body placed after len(head) tokens)`. The heads of every (marker kind,
        sign, lead) are tokenized here; a batch of new answers then costs one batched tokenizer call on their
        bodies (a handful of short strings per answer) and a few tensor ops. A head whose first token straddles
        the marker cut (the answer cannot follow the marker there) yields no spelling.

        Checked on probe answers against tokenizing every spelling whole (`_tails(compose=False)`); a tokenizer that
        fails the check (one that merges digits with what precedes them) adds every answer the general way.
        """
        self._lead_group: dict[tuple[bool, str], int] = {}
        self._split_decimals = False
        if not self._composable or any(ch.isdigit() for text in self.separators + self.prefixes for ch in text):
            return False
        open_kinds = [k for k, p in enumerate(self._kind_prefixes) if p is not None]
        groups: dict[tuple[bool, str], list[str]] = {}
        for negative, probe in ((False, "1"), (True, "-1")):
            sign_prefixes = number_parts(probe, self.prefixes)[0]
            for lead in ("", "."):
                groups[(negative, lead)] = list(
                    dict.fromkeys(sep + sp + lead for sep in self.separators for sp in sign_prefixes)
                )
        head_strings = sorted({h for heads in groups.values() for h in heads})
        got = tails_after(
            self.tokenizer, [(*self._kind_prefixes[k], h + "0") for k in open_kinds for h in head_strings]
        )
        tails: dict[tuple[int, str], tuple[int, ...] | None] = {}
        for (k, h), toks in zip(((k, h) for k in open_kinds for h in head_strings), got, strict=True):
            if toks is not None and (not toks or toks[-1] != self._zero_id):
                return False  # the head merges with the digit after it: spellings must be tokenized whole
            tails[(k, h)] = None if toks is None else toks[:-1]  # None: no spelling (a token straddles the cut)
        # Per (sign, lead) group: its distinct (marker class, head tokens), padded to a common width.
        per_group = {}
        for key, hs in groups.items():
            found = {(self._kind_class[k], tails[(k, h)]) for k in open_kinds for h in hs}
            per_group[key] = sorted((cls, toks) for cls, toks in found if toks is not None)
        width = max(len(v) for v in per_group.values())
        flat = [head for heads in per_group.values() for head in heads]
        keys = self._hash_many([toks for _, toks in flat]).tolist()
        shape = (len(groups), width)
        self._group_head_key = torch.zeros(shape, dtype=torch.long)
        self._group_head_len = torch.zeros(shape, dtype=torch.long)
        self._group_head_class = torch.zeros(shape, dtype=torch.long)
        self._group_head_ok = torch.zeros(shape, dtype=torch.bool)
        i = 0
        for g, (key, heads) in enumerate(per_group.items()):
            self._lead_group[key] = g
            for j, (cls, toks) in enumerate(heads):
                self._group_head_key[g, j], self._group_head_len[g, j] = keys[i], len(toks)
                self._group_head_class[g, j], self._group_head_ok[g, j] = cls, True
                i += 1
        probes = list(_PROBE_GOLDS + _STRUCTURE_PROBES)
        bodies = sorted({b.lstrip(".") for gold in probes for b in number_parts(gold, self.prefixes)[1]})
        self._split_decimals = self._encode_bodies(bodies, split=True) == self._encode_bodies(bodies, split=False)
        composed = self._number_spellings(probes)
        whole = self._generic_spellings(probes, compose=False)
        if composed is None or _as_set(composed) != _as_set(whole):
            self._lead_group = {}
            return False
        return True

    def _number_spellings(self, golds: Sequence[str]) -> tuple[torch.Tensor, ...] | None:
        """`(gold index, marker class, key, length)` of every spelling of the numeric `golds` after every open
        marker kind, composed from the cached heads and one batched tokenizer call on the bodies (see
        `_build_number_heads`). `None` when a gold is not a plain number (the caller adds it the general way)."""
        entry_gold: list[int] = []
        entry_body: list[int] = []
        entry_group: list[int] = []
        body_index: dict[str, int] = {}
        for gi, gold in enumerate(golds):
            bodies = number_parts(gold, self.prefixes)[1]
            if not bodies:
                return None
            negative = gold[0] == "-"
            for body in bodies:
                cut = next(i for i, ch in enumerate(body) if ch.isdigit())
                group = self._lead_group.get((negative, body[:cut]))
                if group is None:
                    return None
                entry_gold.append(gi)
                entry_body.append(body_index.setdefault(body[cut:], len(body_index)))
                entry_group.append(group)
        if not entry_gold:
            return tuple(torch.zeros(0, dtype=torch.long) for _ in range(4))
        body_tokens = self._encode_bodies(list(body_index))
        self._add_to_alphabet(body_tokens)
        ids, mask = pad_completion_ids(body_tokens)
        body_len = mask.sum(1)
        feats = self._feat[ids].long() * mask
        # Key of each body placed after s head tokens, for every s: sum_j feat_j * key_{s + j}. Shifts that push a
        # body past the window get wrong keys here and are dropped below by their length.
        shifts, width = int(self._group_head_len.max()) + 1, ids.shape[1]
        padded_keys = torch.cat([self._keys, torch.zeros(shifts + width, dtype=torch.long)])
        body_key = (feats.unsqueeze(1) * padded_keys.unfold(0, width, 1)[:shifts]).sum(-1)  # (bodies, shifts)

        # Every (entry, head of its group): key = key(head) + key(body after len(head) tokens), read from the
        # flattened (body, shift) table.
        group = torch.tensor(entry_group)
        body = torch.tensor(entry_body)
        head_len = self._group_head_len[group]  # (entries, heads)
        key = self._group_head_key[group] + body_key.view(-1)[(body * shifts).unsqueeze(1) + head_len]
        length = head_len + body_len[body].unsqueeze(1)
        keep = self._group_head_ok[group] & (length <= _MAX_WINDOW - 2)
        gold = torch.tensor(entry_gold).unsqueeze(1).expand_as(key)
        return gold[keep], self._group_head_class[group][keep], key[keep], length[keep]

    def _encode_bodies(self, bodies: list[str], split: bool | None = None) -> list[list[int]]:
        """Token ids of each number body, in one tokenizer call. With `split` (default `_split_decimals`, checked at
        construction) a body is encoded as its integer part and its decimal part (from the `.`), so the few decimal
        endings (`.0`, `.00`) are encoded once for all answers and an integer answer needs one string, not three."""
        if not (self._split_decimals if split is None else split):
            return encode_ids(self.tokenizer, bodies)  # the only tokenizer call
        pieces: dict[str, int] = {}
        parts = []
        for body in bodies:
            head, dot, tail = body.partition(".")
            parts.append((pieces.setdefault(head, len(pieces)), pieces.setdefault(dot + tail, len(pieces))))
        ids = encode_ids(self.tokenizer, list(pieces))  # the only tokenizer call
        return [ids[a] + ids[b] for a, b in parts]

    def _generic_spellings(self, golds: Sequence[str], compose: bool | None = None) -> tuple[torch.Tensor, ...]:
        """`(gold index, marker class, key, length)` of every spelling, each spelling tokenized with its marker
        (`_spellings_by_kind`): any answer, any tokenizer."""
        gold, cls, tails = [], [], []
        for gi, by_kind in enumerate(self._spellings_by_kind(golds, compose)):
            for kind, kind_tails in enumerate(by_kind):
                for tail in kind_tails:
                    gold.append(gi)
                    cls.append(self._kind_class[kind])
                    tails.append(tail)
        keys = self._hash_many(tails) if tails else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([len(t) for t in tails], dtype=torch.long)
        return torch.tensor(gold, dtype=torch.long), torch.tensor(cls, dtype=torch.long), keys, lengths

    # ------------------------------------------------------------------ gold-answer cache
    def spellings(self, answer: Any) -> dict[tuple[int, ...], set[int]]:
        """Token spellings accepted for `answer` right after a marker: `{token ids: {marker classes}}`. The ids
        include the end of the marker that the tokenizer merges with the answer (`{-` for `\\boxed{-12}`)."""
        out: dict[tuple[int, ...], set[int]] = {}
        for kind, tails in enumerate(self._spellings_by_kind([normalize_answer(answer)])[0]):
            for tail in tails:
                out.setdefault(tail, set()).add(self._kind_class[kind])
        return out

    def prepare(self, answers: Sequence[Any] | None = None, /, **columns: Any) -> None:
        """Tokenize the spellings of every gold answer not seen yet, now, so that scoring rows with these answers
        calls no tokenizer.

        `prepare(answers)` or `prepare(**columns)` with the dataset columns `score` gets (the answers are read from
        `columns[answer_column]`; other columns are ignored). All new answers go through one batched tokenizer call
        (`_add_golds`). Safe to call from another thread while this reward scores. `trl_async.rewards.prepare_rewards`
        calls this on every tensor reward."""
        if answers is None:
            if self.answer_column not in columns:
                raise KeyError(
                    f"{self.__name__}.prepare needs the dataset column {self.answer_column!r} (gold answers); got "
                    f"columns {sorted(columns)}"
                )
            answers = columns[self.answer_column]
        answers = list(answers)
        with self._lock:
            self._rows(answers)

    def _add_golds(self, golds: Sequence[str | None]) -> None:
        """Add the table rows of the gold answers not seen yet: every spelling of every new answer, one batched
        tokenizer call for the lot (`_number_spellings`; answers that are not plain numbers, or tokenizers where
        composition is not exact, go through `_generic_spellings`), then one vectorized table write."""
        new = [g for g in dict.fromkeys(golds) if g not in self._gold_rows]
        for start in range(0, len(new), _GOLD_CHUNK):  # chunks keep the (spelling x head) tensors in cache
            self._add_new_golds(new[start : start + _GOLD_CHUNK])

    def _add_new_golds(self, new: list[str]) -> None:
        numeric = [g for g in new if self._structured and number_parts(g, self.prefixes)[1]]
        composed = self._number_spellings(numeric) if numeric else None
        if composed is None:  # no plain numbers (or no composition for this tokenizer): all the general way
            numeric = []
        numeric_set = set(numeric)
        other = [g for g in new if g not in numeric_set]
        new = numeric + other  # table order: the composed answers first
        parts = [] if composed is None else [composed]
        if other:
            gold, cls, key, length = self._generic_spellings(other)
            parts.append((gold + len(numeric), cls, key, length))
        gold, cls, key, length = (torch.cat(t) for t in zip(*parts, strict=True))
        self._write_rows(len(new), gold, cls, key, length)
        for i, g in enumerate(new):
            self._gold_rows[g] = self._n_rows + i
        self._n_rows += len(new)  # last: a device state copies rows up to `_n_rows`

    def _write_rows(
        self, n_golds: int, gold: torch.Tensor, cls: torch.Tensor, key: torch.Tensor, length: torch.Tensor
    ) -> None:
        """Write the sorted, deduplicated keys of each new table row `(n_rows + gold) * stride + class`."""
        first = self._n_rows * self._stride
        row = first + gold * self._stride + cls
        # Sort by (row, key): stable sorts by key, then by row. Drop repeats (one spelling after two marker kinds
        # of the same class, or two spellings with the same tokens).
        order = torch.argsort(key, stable=True)
        row, key = row[order], key[order]
        order = torch.argsort(row, stable=True)
        row, key = row[order], key[order]
        keep = torch.ones_like(row, dtype=torch.bool)
        keep[1:] = (row[1:] != row[:-1]) | (key[1:] != key[:-1])
        row, key = row[keep], key[keep]
        rows, counts = torch.unique_consecutive(row, return_counts=True)
        rank = torch.arange(row.numel()) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        # Every row keeps at least one padding key at its end (`searchsorted` then never runs past it).
        need_rows = first + n_golds * self._stride
        need_width = int(counts.max()) + 1 if counts.numel() else 1
        cap, width = self._table.shape
        if need_rows > cap or need_width > width:
            cap = max(need_rows, cap + cap // 2)  # geometric growth: each growth re-uploads the table to a device
            grown = torch.full((cap, max(width, need_width)), _KEY_PAD, dtype=torch.long)
            grown[:first, :width] = self._table[:first]
            self._table = grown
            self._version += 1
        self._table[row, rank] = key
        if length.numel():
            self._max_len = max(self._max_len, int(length.max()))

    def _add_to_alphabet(self, tails: Sequence[Sequence[int]]) -> None:
        """Give every token of `tails` not yet in the answer alphabet the next code (features of tokens already in
        it never change, so keys already stored stay valid)."""
        alphabet = self._alphabet
        new = sorted({t for tail in tails for t in tail} - alphabet.keys())
        if not new:
            return
        if len(alphabet) + len(new) + 2 > _MAX_CODES:
            raise ValueError(f"more than {_MAX_CODES - 2} distinct tokens in answer spellings")
        for t in new:
            alphabet[t] = len(alphabet) + 2
        ids = torch.tensor(new, dtype=torch.long)
        codes = torch.tensor([alphabet[t] for t in new], dtype=torch.int16)
        self._feat[ids] = 4 * codes + self._number_class[ids]
        self._version += 1

    def _hash_many(self, tails: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """Keys of token sequences: sum_j feature(token_j) * key_j, with the window features (4 * answer-alphabet
        code + number class; new tokens are added to the alphabet). Features < 2**14, keys < 2**_KEY_BITS and at
        most 62 terms: no int64 overflow."""
        self._add_to_alphabet(tails)
        ids, mask = pad_completion_ids(tails, pad_id=0)
        feats = self._feat[ids].long() * mask
        return (feats * self._keys[: feats.shape[1]]).sum(-1)

    @staticmethod
    def _key(answer: Any) -> Hashable:
        return answer if isinstance(answer, Hashable) else repr(answer)

    def _rows(self, answers: Sequence[Any]) -> list[int]:
        """First table row (gold row * (C + 1)) of each answer; 0 for a missing answer. Call under `_lock`."""
        index = self._index
        try:
            return [index[a] for a in answers]
        except (KeyError, TypeError):
            pass
        missing = {self._key(a): a for a in answers if self._key(a) not in index}
        golds = {key: normalize_answer(a) for key, a in missing.items()}
        self._add_golds(list(golds.values()))
        for key, gold in golds.items():
            index[key] = self._gold_rows[gold] * self._stride
        return [index[self._key(a)] for a in answers]

    # ------------------------------------------------------------------ device state
    def _state(self, device: torch.device) -> _DeviceState:
        st = self._device_cache.get(device)
        if st is None:
            st = self._device_cache[device] = _DeviceState(self, device)
        if st.version != self._version:
            st.sync(self)
        elif st.rows < self._n_rows:
            st.sync_rows(self)
        return st

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    @property
    def required_columns(self) -> tuple[str, ...]:
        return (self.answer_column,)

    # ------------------------------------------------------------------ scoring
    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        if self.answer_column not in columns:
            raise KeyError(f"{self.__name__} needs the dataset column {self.answer_column!r} (gold answers)")
        answers = columns[self.answer_column]
        batch, length = completion_ids.shape
        if len(answers) != batch:
            raise ValueError(f"{self.__name__}: {len(answers)} answers for {batch} completions")
        device = completion_ids.device
        with self._lock:  # a consistent snapshot of the tables (a `prepare` in another thread may grow them)
            rows = self._rows(answers)  # answers not prepared are added here (outside inference mode)
            st = self._state(device)
            window = self._max_len + 3  # answer spellings of up to max_len tokens + 2 for the boundary
        first_row = to_device(torch.frombuffer(array("q", rows), dtype=torch.long), device).view(batch, 1)
        if length == 0:
            out = torch.zeros(batch, dtype=torch.float32, device=device)
        else:
            with torch.inference_mode():  # fewer dispatch steps per op; only the float result leaves the block
                hit = self._match(st, completion_ids, completion_mask, first_row, batch, length, window)
            out = hit.to(torch.float32)
        if 0 in rows:  # rows without a gold answer: "does not apply" (TRL semantics)
            return torch.where(first_row.view(-1) == 0, torch.nan, out)
        return out

    def _match(
        self,
        st: _DeviceState,
        ids: torch.Tensor,
        mask: torch.Tensor,
        first_row: torch.Tensor,
        batch: int,
        length: int,
        wn: int,
    ) -> torch.Tensor:
        ws = st.workspace(self, batch, length, wn)

        # 1. Padded ids (reused buffer): km sentinels, the ids (out-of-range ids read as the sentinel; positions
        #    outside the mask as the "masked" id, which acts as an EOS), wn sentinels (the window may run past the
        #    end). Flattened, the padding also separates the rows.
        torch.clamp(ids if ids.dtype == torch.long else ids.long(), 0, self.sentinel, out=ws.mid)
        torch.where(mask if mask.dtype == torch.bool else mask.bool(), ws.mid, st.masked_id, out=ws.mid)

        # 2. The last marker before the first stop, packed as `OFF + ((p + 1) << bits) + class` (p: its last
        #    token's padded position); `OFF` (class 0) when there is none.
        best = _last_marker(self, st, ws)

        # 3. The window after it. Tokens after the first stop need no masking: the stop itself (EOS or "masked")
        #    is in no answer spelling and ends every number.
        feat = st.feat.index_select(0, ws.padded.gather(1, (best >> self._class_bits) + ws.window_offsets).view(-1))
        feat = feat.view(batch, wn)  # 4 * answer-alphabet code + number class, per window token
        keys = torch.mul(feat[:, :-2], ws.keys).cumsum_(1)  # prefix keys, lengths 1 .. wn - 2
        num = feat & 3
        ends = torch.add(num[:, 2:], num[:, 1:-1], alpha=4) < 7  # the token after the prefix does not continue it

        # 4. Look each prefix key up in the sorted keys of (row's gold answer, marker class); every table row ends
        #    in padding larger than any key, so `searchsorted` stays in range.
        table = st.table.index_select(0, (first_row + (best & self._class_mask)).view(-1))  # (B, V)
        found = table.gather(1, torch.searchsorted(table, keys))
        return ((found == keys) & ends).any(1)
