"""M2PO: policy-gradient losses for asynchronous (stale) rollouts.

M2PO -- Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161).  Pure tensor functions: no trainer state, nothing
imported from the rest of ``trl_async``.

Read the files in this order:

1. ``reference.py``: the rule as the paper prints it (Algorithm 1), one token at a time, with the math -- delta, the
   trust-region candidates, the masking loop, the objective.  ``m2po_mask_reference``.
2. ``loss.py``: the loss, J = (1/N) sum_t M_t r_t A_t.  ``m2po_loss``.
3. ``fast.py``: the same selection vectorized, as the trainers run it, with its fast paths (rules ``"paper"`` and
   ``"all_tokens"``).  ``m2po_select``, ``m2po_mask``.  ``selection.py`` holds what it shares with the other paths:
   the result ``M2POSelection``, the prepared tokens and the count of tokens to mask.
4. ``authors_code.py``: the rule ``"authors_code"``, the clip cut of the authors' training code.
5. ``global_scope.py``: one selection over every rank's optimizer batch.  ``m2po_select_global``.
6. ``stats.py``: what a selection reports and what is logged.  ``M2POStats``, ``m2po_metrics``.

With behaviour policy mu (the policy that sampled the tokens) and current policy pi_theta, per valid completion
token t::

    delta_t = log pi_theta(y_t | .) - log mu(y_t | .)          (log importance ratio)
    r_t     = exp(delta_t)

A token is a *trust-region token* when its ratio moves with its advantage, the two quadrants in which PPO's clip
would bind::

    (A_t > 0 and delta_t > 0)  or  (A_t < 0 and delta_t < 0)

Three selection rules, each named after its source (``rule=``; docs/m2po.md has the table):

``"paper"`` (default) -- Algorithm 1 of the paper, as printed in its figure (Infini-AI-Lab/M2PO
    ``docs/static/m2po-images/alg.jpg``, AReaL ``docs/figures/m2po_masking.png``) and as ms-swift (PR #9965) and
    Trinity-RFT (PR #616, ``trinity/algorithm/policy_loss_fn/m2po_policy_loss.py``) implement it:
    T <- all trust-region tokens; while mean_{i in T} delta_i^2 > tau_M2, drop the largest from T.  Tokens outside
    the trust region are never masked.  Objective J = (1/N) sum_t M_t r_t A_t, no epsilon-clip, N = valid tokens
    before masking.
``"all_tokens"`` -- every valid token is a candidate and the mean is over all remaining valid tokens: AReaL's
    candidate set (PR #480, ``areal/engine/ppo/actor.py``), and what wave 1 shipped.  If no non-empty kept set meets
    the bound, nothing is kept and the call is flagged ``all_masked`` (never a silent division by zero).
``"authors_code"`` -- what the authors' training code computes (Infini-AI-Lab/M2PO
    ``verl/trainer/ppo/core_algos.py``, ``kpo_clip_harmful_tokens`` / ``_solve_tau_from_sorted_delta2`` /
    ``compute_m2po_policy_loss``), and so what produced the paper's numbers: over the harmful (trust-region) tokens
    it finds a cut tau_c at which the mean of min(delta^2, tau_c^2) is <= tau_M2 and applies the PPO clip
    [exp(-tau_c), exp(tau_c)]; no clip when the budget already holds.  Optional floors (their ``miniclip_low`` /
    ``miniclip_high``, 0.3 / 0.5 in the function signature) are off in every shipped script and off by default here.

All three are computed on the detached delta.  The gradient is d loss / d log pi_t = -w_t r_t A_t / N with
w_t = 1 on kept tokens, 0 on masked (or clipped) ones.

Selection scope: :func:`m2po_select` selects over the tensor it is given (one micro-batch on one rank, as the
authors' code and AReaL do).  :func:`m2po_select_global` selects over the whole optimizer batch across the ranks of
a process group, as the ms-swift and Trinity PRs do, and gives the same answer as :func:`m2po_select` on the
concatenation of every rank's tokens.
"""

from .fast import m2po_mask, m2po_select
from .global_scope import m2po_select_global
from .loss import m2po_loss
from .reference import m2po_mask_reference
from .selection import M2PO_RULES, M2PO_SCOPES, M2POSelection
from .stats import M2PO_STAT_KEYS, M2PO_SUM_KEYS, M2POStats, m2po_metrics

__all__ = [
    "M2PO_RULES",
    "M2PO_SCOPES",
    "M2PO_STAT_KEYS",
    "M2PO_SUM_KEYS",
    "M2POSelection",
    "M2POStats",
    "m2po_loss",
    "m2po_mask",
    "m2po_metrics",
    "m2po_select",
    "m2po_mask_reference",
    "m2po_select_global",
]
