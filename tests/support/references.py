"""Independent re-derivations the tests compare the library with (plain Python, written from the sources)."""

from __future__ import annotations

import math

import torch


def reference_weights(current, behaviour, mask, mode, clip_min, clip_max):
    """Plain-Python re-derivation of TRL 1.16's vLLM importance-sampling ratio."""
    rows = []
    for c_row, b_row, m_row in zip(current.tolist(), behaviour.tolist(), mask.tolist(), strict=True):
        diffs = [(c - b) * m for c, b, m in zip(c_row, b_row, m_row, strict=True)]
        values = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        if mode.endswith("truncate"):
            values = [min(max(v, low), high) for v in values]
        else:
            values = [v if low <= v <= high else 0.0 for v in values]
        rows.append(values)
    return torch.tensor(rows, dtype=torch.float64)
