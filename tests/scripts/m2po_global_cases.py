"""Cases of the 2-process global M2PO test (tests/test_losses_global.py): every rank builds its own part of each
case from the same seeds.  Pure torch + random, so that the worker processes need not import trl_async."""

from __future__ import annotations

import random

import torch

WORLD = 2


def _tokens(rng: random.Random, shape, style: str, adv_style: str = "rows"):
    B, T = shape
    n = B * T
    if style == "heavy":
        vals = [
            rng.gauss(0, 0.15) if rng.random() > 0.12 else rng.choice([-1, 1]) * rng.uniform(0.4, 2.0)
            for _ in range(n)
        ]
    elif style == "grid":  # ties within and across ranks; 1/256 steps keep delta^2 exact
        vals = [rng.choice([-96, -64, -32, 0, 16, 32, 64, 96]) / 256 for _ in range(n)]
    elif style == "big":  # every |delta| > 0.3: "all_tokens" is infeasible
        vals = [rng.choice([-1, 1]) * rng.uniform(0.3, 1.5) for _ in range(n)]
    elif style == "small":
        vals = [rng.gauss(0, 0.05) for _ in range(n)]
    else:
        raise AssertionError(style)
    delta = torch.tensor(vals, dtype=torch.float32).reshape(B, T)
    mask = torch.arange(T)[None, :] < torch.tensor([rng.randint(0, T) for _ in range(B)])[:, None]
    if adv_style == "rows":
        adv = torch.tensor([rng.choice([-1.0, 1.0]) * (0.2 + rng.random()) for _ in range(B)])
    elif adv_style == "tokens":
        adv = torch.randn(B, T, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
    else:  # no trust-region token
        adv = torch.zeros(B)
    return delta, mask, adv


def make_case(case: int, rank: int):
    """(tensors, rule, tau, floors) of one case on one rank; tensors is (delta, mask, adv) or a list of them."""
    rng = random.Random(1000 * case + rank)
    rules = ["paper", "all_tokens", "authors_code"]
    shapes = [(3, 17), (5, 9)]
    if case < 9:  # every rule x {heavy tails, ties across ranks, mostly small with a few outliers}
        rule, style = rules[case % 3], ["heavy", "grid", "heavy"][case // 3]
        return _tokens(rng, shapes[rank], style, "tokens" if case >= 6 else "rows"), rule, 0.04, (None, None)
    if case == 9:  # rank 1 has no valid token at all
        delta, mask, adv = _tokens(rng, shapes[rank], "heavy")
        return (delta, mask & (rank == 0), adv), "paper", 0.04, (None, None)
    if case == 10:  # rank 0 has no trust-region token
        return _tokens(rng, shapes[rank], "heavy", "zero" if rank == 0 else "rows"), "paper", 0.04, (None, None)
    if case == 11:  # infeasible "all_tokens": nothing kept anywhere
        return _tokens(rng, shapes[rank], "big"), "all_tokens", 0.04, (None, None)
    if case == 12:  # all candidates above tau on rank 1 only, none on rank 0
        return _tokens(rng, shapes[rank], "small" if rank == 0 else "big"), "paper", 0.04, (None, None)
    if case == 13:  # NaN on a valid token of rank 1: nothing kept on either rank
        delta, mask, adv = _tokens(rng, shapes[rank], "heavy")
        if rank == 1:
            delta[0, 0], mask[0, 0] = float("nan"), True
        return (delta, mask, adv), "all_tokens", 0.04, (None, None)
    if case == 14:  # gradient accumulation: each rank passes its micro-batches as a list
        mbs = [_tokens(rng, (2 + rank, 11 + 3 * i), "heavy") for i in range(2 + rank)]
        return [list(t) for t in zip(*mbs, strict=True)], "paper", 0.04, (None, None)
    if case == 15:  # authors' floors
        return _tokens(rng, shapes[rank], "grid"), "authors_code", 0.04, (0.3, 0.5)
    if case == 16:  # a larger, stale batch with uneven lengths (the payload sizes differ a lot)
        return _tokens(rng, (8, 64 + 40 * rank), "heavy"), "all_tokens", 0.02, (None, None)
    raise IndexError(case)


N_CASES = 17
