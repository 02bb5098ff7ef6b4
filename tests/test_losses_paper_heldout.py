"""Held-out check of the default rule: Algorithm 1 of the M2PO paper, literally, against
``m2po_mask(..., advantages=A, rule="paper")`` on hundreds of random cases.

Written on its own (no helper shared with test_losses.py) from the algorithm figure (arXiv:2510.01161,
Algorithm 1 "M2PO Masking"; also in Infini-AI-Lab/M2PO ``docs/static/m2po-images/alg.jpg`` and AReaL
``docs/figures/m2po_masking.png``):

    1  M <- True for all tokens
    2  T <- all trust-region tokens            ((A > 0 and r > 1) or (A < 0 and r < 1))
    3  while mean_{i in T} M2_i > tau_M2 do
    4      j <- argmax_{i in T} M2_i
    5      M_j <- False;  T <- T \\ {j}
    6  end while
    7  return M

with M2_i = (log r_i)^2 and r_i = pi_theta / mu.  Padding is not a training token (M = False there).  Among equal
M2 the argmax is taken as the lowest flat index, the tie rule m2po_mask documents.  M2 is computed in float32, the
precision the tensors hold.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from trl_async.algorithms.m2po import m2po_mask


def algorithm_1(log_ratio: np.ndarray, advantage: np.ndarray, valid: np.ndarray, tau: float) -> np.ndarray:
    """The loop of the figure, one token at a time, over flat float32 arrays."""
    m2 = (log_ratio.astype(np.float32) * log_ratio.astype(np.float32)).astype(np.float32)
    M = valid.copy()  # line 1 (padding is never a training token)
    T = [
        i
        for i in range(len(m2))
        if valid[i] and ((advantage[i] > 0 and log_ratio[i] > 0) or (advantage[i] < 0 and log_ratio[i] < 0))
    ]  # line 2
    while T and sum(float(m2[i]) for i in T) / len(T) > tau:  # line 3
        j = T[0]
        for i in T:  # line 4: argmax, lowest index among equals (T is in index order)
            if m2[i] > m2[j]:
                j = i
        M[j] = False  # line 5
        T.remove(j)
    return M


def _draw(rng: random.Random):
    B, L = rng.randint(1, 8), rng.randint(1, 96)
    style = rng.choice(["gauss", "heavy", "grid", "stale", "fresh"])
    values = []
    for _ in range(B * L):
        if style == "gauss":
            x = rng.gauss(0, rng.choice([0.05, 0.2, 0.4]))
        elif style == "heavy":
            x = rng.gauss(0, 0.1) if rng.random() > 0.1 else rng.choice([-1, 1]) * rng.expovariate(1.0)
        elif style == "grid":  # ties
            x = rng.choice([-0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5])
        elif style == "stale":
            x = rng.gauss(0, 0.6)
        else:
            x = rng.gauss(0, 0.02)
        values.append(x)
    log_ratio = np.array(values, dtype=np.float32).reshape(B, L)
    lengths = [rng.randint(0, L) for _ in range(B)]
    valid = np.array([[t < n for t in range(L)] for n in lengths], dtype=bool)
    adv_style = rng.choice(["rows", "tokens", "positive", "negative", "none"])
    if adv_style == "rows":  # GRPO: one advantage per completion, some exactly 0
        adv = np.repeat(np.array([rng.choice([-1, 0, 1]) * rng.random() for _ in range(B)], np.float32)[:, None], L, 1)
    elif adv_style == "tokens":
        adv = np.array([rng.gauss(0, 1) for _ in range(B * L)], np.float32).reshape(B, L)
    elif adv_style == "positive":
        adv = np.full((B, L), 0.7, np.float32)
    elif adv_style == "negative":
        adv = np.full((B, L), -0.7, np.float32)
    else:
        adv = np.zeros((B, L), np.float32)
    tau = rng.choice([0.04, 0.04, 0.01, 0.1, 0.25])
    return log_ratio, adv, valid, tau


def test_algorithm_1_held_out():
    rng = random.Random(20251002)
    n_cases, n_masking = 600, 0
    for _ in range(n_cases):
        log_ratio, adv, valid, tau = _draw(rng)
        expected = algorithm_1(log_ratio.reshape(-1), adv.reshape(-1), valid.reshape(-1), tau)
        got = m2po_mask(torch.from_numpy(log_ratio), torch.from_numpy(valid), tau, torch.from_numpy(adv), "paper")
        assert got.reshape(-1).tolist() == expected.tolist()
        n_masking += int(expected.sum() < valid.sum())
    assert n_masking > n_cases // 4  # a good share of the cases mask something
