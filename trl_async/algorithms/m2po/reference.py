"""M2PO's rule as the paper prints it, one token at a time.  Read this file first.

Zheng, Zhao & Chen 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
arXiv:2510.01161, Algorithm 1 (M2PO, Second-Moment Trust Policy Optimization).

The setting.  The completions were sampled by a behaviour policy mu (the generator, possibly some optimizer steps
behind) and the loss trains the current policy pi_theta.  For every valid completion token t (padding excluded):

    delta_t = log pi_theta(y_t | .) - log mu(y_t | .)        the log importance ratio
    r_t     = exp(delta_t)                                   the importance ratio
    A_t                                                      the token's advantage (GRPO: its sequence's)

The candidates.  A token is a *trust-region token* when its ratio moves with its advantage -- the two quadrants in
which PPO's clip would bind.  Only these tokens can be masked:

    T = { t valid : (A_t > 0 and delta_t > 0) or (A_t < 0 and delta_t < 0) }

The rule.  Bound the second moment of delta over the candidates (tau = tau_M2, 0.04 in the paper), dropping the
largest delta^2 first:

    while T is not empty and (1/|T|) sum_{t in T} delta_t^2 > tau:
        remove from T the token with the largest delta_t^2
    M_t = 0 for every removed token, M_t = 1 for every other valid token

The objective has no epsilon-clip.  With N the number of valid tokens before masking:

    J = (1/N) sum_t M_t r_t A_t,      loss = -J,      d loss / d log pi_theta(y_t | .) = -M_t r_t A_t / N

so a masked token carries no gradient and a kept one its plain policy-gradient term.

Where the rest lives: ``loss.py`` computes J (``m2po_loss``); ``fast.py`` makes this same selection vectorized
(``m2po_select``, rule ``"paper"``, the one the trainers run), and ``tests/test_m2po_reference.py`` checks that the
two agree.  The other readings of M2PO (``"all_tokens"``, ``"authors_code"``) are described in ``__init__.py`` and
docs/m2po.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def m2po_mask_reference(log_ratio: Tensor, mask: Tensor, advantages: Tensor, threshold: float = 0.04) -> Tensor:
    """Algorithm 1 of Zheng et al. 2025 (the ``"paper"`` rule), one token at a time: M_t, True where a token is kept.

        T <- {t valid : (A_t > 0 and delta_t > 0) or (A_t < 0 and delta_t < 0)}          (the trust-region tokens)
        while T is not empty and mean_{t in T} delta_t^2 > tau:
            remove from T the token with the largest delta_t^2 (ties: the lower flat index first)
        M_t = 0 for the removed tokens, 1 for every other valid token (padding: 0)

    Args:
        log_ratio: delta = log pi_theta - log mu, e.g. ``(B, T)``; used detached.
        mask: valid-token mask, the shape of ``log_ratio`` (or broadcastable to it).
        advantages: ``(B,)`` (one per sequence) or the shape of ``log_ratio``.
        threshold: tau_M2.

    O(n^2) in the worst case and one host read per token: for reading beside the vectorized path, and for testing it.
    delta^2 is ranked in float32 and the means are taken in float64, as in ``m2po_select``, so the two agree on
    finite inputs (``tests/test_m2po_reference.py``).
    """
    delta = log_ratio.detach().float().reshape(-1).tolist()
    valid = mask.to(torch.bool).expand(log_ratio.shape).reshape(-1).tolist()
    advantages = advantages.detach().float()
    if advantages.dim() == 1 and log_ratio.dim() >= 2:
        advantages = advantages.unsqueeze(1)  # one advantage per sequence: (B,) -> (B, 1), as TRL does
    adv = advantages.expand(log_ratio.shape).reshape(-1).tolist()
    d2 = log_ratio.detach().float().square().reshape(-1).tolist()  # float32 squares, as the ranking uses

    # T: the trust-region tokens, the only ones that can be masked.
    trust = [
        i for i, ok in enumerate(valid) if ok and ((adv[i] > 0 and delta[i] > 0) or (adv[i] < 0 and delta[i] < 0))
    ]
    keep = list(valid)  # M_t: every valid token starts kept, padding never is
    remaining = sorted(trust, key=lambda i: (-d2[i], i))  # removal order: largest delta^2 first, lower index first
    total = math.fsum(d2[i] for i in remaining)
    # While the mean delta^2 over what is left of T exceeds tau, drop the largest.
    while remaining and total / len(remaining) > threshold:
        dropped = remaining.pop(0)
        keep[dropped] = False
        total = math.fsum(d2[i] for i in remaining)
    return torch.tensor(keep, dtype=torch.bool, device=log_ratio.device).view(log_ratio.shape)
