"""The device side of `MathAnswerReward` (`math_answer.py`): where the last answer marker ends, and the tensors each
call reuses.

`math_answer.py` describes the whole match (its steps 1-6). This module holds the marker search of its step 3 and what
scoring keeps on each device:

* `_build_marker_tables`, once at construction: the code of every vocabulary id (marker tokens 1..U, EOS U+1, all
  others 0) and the lookup of a marker's class by the codes of its last tokens -- a table of *steps* over the codes of
  the last km + 1 tokens when that table is small (byte-level BPE vocabularies spell a marker in 1-3 tokens), else
  sorted per-length encodings searched with `searchsorted` (small vocabularies spell `\\boxed` letter by letter).
* `_last_marker`, per call: the last marker before the first stop in every row, in one running sum (or the sorted
  encodings), packed with its class in one int64.
* `_DeviceState`: the reward's tensors on one device, brought up to date when the gold-answer table grows, and
  `_Workspace`: the buffers of one batch shape, reused from call to call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ._tokens import reduce_alphabet
from .base import to_device


class MarkerReward(Protocol):
    """What this module reads of a `MathAnswerReward` (its tables, built by `_build_marker_tables` and the reward)."""

    sentinel: int
    _class_bits: int
    _km: int
    _base: int
    _eos_code: int
    _code: torch.Tensor
    _step_lut: torch.Tensor | None
    _class_by_length: list
    _keys: torch.Tensor
    _feat: torch.Tensor
    _table: torch.Tensor
    _n_rows: int
    _stride: int
    _version: int


_POS_BITS = 24  # padded completion length < 2**24
_OFF = 1 << _POS_BITS  # (shifted by the class bits) added at marker ends: markers outrank every other position
_MAX_STEP_TABLE = 2**21  # entries of the (km + 1)-token step table; larger: the sorted-encodings path
_NO_MARKER = -(2**30)


@dataclass
class _MarkerTables:
    """What `_build_marker_tables` gives the reward (it keeps each field as `reward._<name>`)."""

    code: torch.Tensor  # per vocabulary id, + the sentinel (0) and the "masked" id (a stop): its marker code
    eos_code: int  # the code of the stops (EOS ids and the "masked" id): U + 1
    base: int  # U + 2: the codes of consecutive tokens are the digits of one base-`base` integer
    km: int  # tokens in the longest marker spelling
    class_bits: int  # bits of a marker class in the packed result of `_last_marker`
    class_lut: torch.Tensor | None = None  # step-table path: marker class by the codes of the last km tokens
    class_by_length: list = field(default_factory=list)  # sorted-encodings path: (length, encodings, classes)
    step_lut: torch.Tensor | None = None  # step-table path: the step of each (km + 1)-token code


def _build_marker_tables(
    variants: list[tuple[tuple[int, ...], int]],
    n_classes: int,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    sentinel: int,
) -> _MarkerTables:
    """Code table (marker tokens 1..U, interchangeable tokens sharing a code; EOS U+1) and the class lookup over the
    codes of the last km tokens, from the marker spellings `variants` (`(token ids, marker class)`, none holding an
    EOS id): a direct table when (U+2)**km is small, else sorted per-length encodings."""
    code_of = reduce_alphabet(variants)
    eos_code = max(code_of.values()) + 1
    base = eos_code + 1
    km = max(len(toks) for toks, _ in variants)
    if base**km >= 2**62:
        raise ValueError(f"marker spellings too long for exact matching ({base} codes, {km} tokens)")
    use_table = base ** (km + 1) <= _MAX_STEP_TABLE
    code_dtype = torch.int32 if use_table else torch.int64
    code = torch.zeros(vocab_size + 2, dtype=code_dtype)  # + the sentinel (0) and the "masked" id (EOS)
    tokens = sorted(code_of)
    code[torch.tensor(tokens, dtype=torch.long)] = torch.tensor([code_of[t] for t in tokens], dtype=code_dtype)
    eos = [e for e in eos_token_ids if e < vocab_size] + [sentinel + 1]
    code[torch.tensor(eos, dtype=torch.long)] = eos_code
    tables = _MarkerTables(code=code, eos_code=eos_code, base=base, km=km, class_bits=n_classes.bit_length())
    encoded = [(len(toks), sum(code_of[toks[len(toks) - 1 - j]] * base**j for j in range(len(toks))), cls)
               for toks, cls in variants]  # fmt: skip
    if use_table:
        lut = torch.zeros(base**km, dtype=torch.long)
        longest = torch.zeros(base**km, dtype=torch.long)
        for k, enc, cls in encoded:
            view, best = lut[enc :: base**k], longest[enc :: base**k]
            take = best < k  # the longest (most specific) spelling ending here wins
            view.copy_(torch.where(take, cls, view))
            best.copy_(torch.where(take, k, best))
        # "No marker" is a large negative number: `(position << bits) + lut` is then positive exactly at marker
        # ends, and one `amax` finds the last marker and its class.
        tables.class_lut = torch.where(lut == 0, _NO_MARKER, lut).to(torch.int32)
        # Step table over the codes of the last km + 1 tokens (see `_last_marker`): the running sum of
        # `step - BIG * stop + cv(last km tokens) - cv(the km tokens before)` telescopes to the position, the
        # stop count and the marker value cv (OFF + class at a marker end, else 0) at each position.
        off = _OFF << tables.class_bits
        cv = torch.where(lut == 0, 0, off + lut)
        r = torch.arange(base ** (km + 1))
        stop = (r % base == eos_code).long()
        tables.step_lut = (1 << tables.class_bits) - 4 * off * stop + cv[r % base**km] - cv[r // base]
    else:
        for length in sorted({k for k, _, _ in encoded}):  # ascending: a longer spelling overrides a shorter
            table = dict(sorted((enc, cls) for k, enc, cls in encoded if k == length))
            tables.class_by_length.append(
                (length, torch.tensor(list(table), dtype=torch.long), torch.tensor(list(table.values())))
            )
    return tables


def _last_marker(reward: MarkerReward, st: _DeviceState, ws: _Workspace) -> torch.Tensor:
    """The last marker before the first stop in each row, packed as `OFF + ((p + 1) << bits) + class` (p: its last
    token's padded position); `OFF` (class 0) when there is none. Shape `(B, 1)`."""
    off = _OFF << reward._class_bits
    if st.step_lut is not None:
        # Codes of every token, then of the last km + 1 tokens at each position (one base-(U+2) integer, in
        # place over the flattened buffer: the km sentinels before a row keep the rows apart). They index a
        # table of steps `step - BIG * (token is a stop) + cv(last km tokens) - cv(the km tokens before)`,
        # where cv is OFF + class at a marker end and 0 elsewhere: the running sum telescopes to
        # `(p + 1) * step - BIG * (stops up to p) + cv(p)`, at least OFF exactly at a marker end before the first
        # stop, below OFF at other positions before it, negative from the first stop on.
        torch.index_select(st.code, 0, ws.flat, out=ws.code)
        for out, a, b, alpha in ws.rolling:
            torch.add(a, b, alpha=alpha, out=out)
        torch.index_select(st.step_lut, 0, ws.rolled, out=ws.steps)
        return ws.running.cumsum_(1).amax(1, keepdim=True).clamp_(min=off)
    # Sorted encodings (long marker spellings): codes zeroed from the first stop on, then per spelling length.
    km, base, o = reward._km, reward._base, reward._km
    batch, width = ws.padded.shape
    code = st.code.index_select(0, ws.flat).view(batch, width)
    code = code * ((code == reward._eos_code).cumsum(1) == 0)
    rolled = code[:, o:]
    for j in range(1, km):
        rolled = torch.add(rolled, code[:, o - j : width - j], alpha=base**j)
    classes = torch.zeros_like(rolled)
    for k, encs, cls in st.class_by_length:  # ascending k: a longer spelling overrides a shorter one
        suffix = rolled % base**k if k < km else rolled  # codes of the last k tokens
        at = torch.searchsorted(encs, suffix).clamp_(max=encs.numel() - 1)
        classes = torch.where(encs[at] == suffix, cls[at], classes)
    packed = torch.where(classes > 0, ws.positions[o:] + classes, 0)
    return packed.amax(1, keepdim=True).clamp_(min=off)


class _Workspace:
    """Buffers and views of one batch shape on one device, reused from call to call: `score` overwrites them, and
    nothing outside a call keeps a reference to them (so one reward object must not score from several threads at
    once)."""

    def __init__(self, reward: MarkerReward, st: _DeviceState, batch: int, length: int, window: int):
        device, o, shift = st.device, reward._km, reward._class_bits
        width = o + length + window
        if width >= 1 << _POS_BITS:
            raise ValueError(f"completions of {length} tokens are too long for MathAnswerReward")
        self.padded = torch.full((batch, width), reward.sentinel, dtype=torch.long, device=device)
        self.flat, self.mid = self.padded.view(-1), self.padded[:, o : o + length]
        # window start = (best >> bits) - OFF
        self.window_offsets = torch.arange(window, dtype=torch.long, device=device) - _OFF
        self.keys = st.keys[: window - 2]
        self.positions = (_OFF << shift) + (torch.arange(1, width + 1, dtype=torch.long, device=device) << shift)
        if st.step_lut is None:
            return
        # Rolling code over km + 1 tokens, by doubling where it can: (out, a, b, alpha) with out = a + alpha * b.
        # Entries that no step writes stay 0 (they only cover the first row's padding).
        n, digits, base = batch * width, reward._km + 1, reward._base
        self.code = torch.zeros(n, dtype=torch.int32, device=device)
        self.rolling: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        acc, w = self.code, 1
        while 2 * w <= digits:
            out = torch.zeros(n, dtype=torch.int32, device=device)
            self.rolling.append((out[w:], acc[w:], acc[:-w], base**w))
            acc, w = out, 2 * w
        for j in range(w, digits):  # one more digit (acc covers the j tokens ending at each position)
            out = torch.zeros(n, dtype=torch.int32, device=device)
            self.rolling.append((out[j:], acc[j:], self.code[:-j], base**j))
            acc = out
        self.rolled = acc
        self.steps = torch.empty(n, dtype=torch.long, device=device)
        self.running = self.steps.view(batch, width)


class _DeviceState:
    """Tensors of one `MathAnswerReward` on one device, and per-shape workspaces."""

    def __init__(self, reward: MarkerReward, device: torch.device):
        self.device = device
        self.code = to_device(reward._code, device)
        self.step_lut = None if reward._step_lut is None else to_device(reward._step_lut, device)
        self.class_by_length = [(k, to_device(e, device), to_device(c, device)) for k, e, c in reward._class_by_length]
        self.keys = to_device(reward._keys, device)
        self.masked_id = torch.tensor(reward.sentinel + 1, dtype=torch.long, device=device)
        self.version, self.rows = -1, 0
        self._workspaces: dict[tuple[int, int, int], _Workspace] = {}
        self.sync(reward)

    def sync(self, reward: MarkerReward) -> None:
        # On the host's own device these are the reward's tensors themselves (appended rows show up directly).
        self.feat = to_device(reward._feat, self.device)
        self.table = to_device(reward._table, self.device)
        self.version, self.rows = reward._version, reward._n_rows

    def sync_rows(self, reward: MarkerReward) -> None:
        lo, hi = self.rows * reward._stride, reward._n_rows * reward._stride
        if self.table is not reward._table:
            self.table[lo:hi] = to_device(reward._table[lo:hi], self.device)
        self.rows = reward._n_rows

    def workspace(self, reward: MarkerReward, batch: int, length: int, window: int) -> _Workspace:
        key = (batch, length, window)
        ws = self._workspaces.get(key)
        if ws is None:
            if len(self._workspaces) >= 4:  # completion lengths vary from step to step: keep only a few
                self._workspaces.clear()
            ws = self._workspaces[key] = _Workspace(reward, self, batch, length, window)
        return ws
