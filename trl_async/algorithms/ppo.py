"""PPO with a learned critic: the math, as pure tensor functions (no trainer, no model).

Every function works on right-padded completions of shape (B, T) with a ``mask`` (bool or 0/1) of the valid
completion tokens. The valid tokens of a row form a prefix (TRL's ``completion_mask``: 1 up to and including the
first EOS); a row may be empty. Nothing here syncs the host with the device.

Conventions (the trainer must produce tensors that follow them):

* ``logps[b, t]`` is log π(y_t | x, y_<t) of completion token t.
* ``values[b, t]`` is the critic's V(s_t) of the state *before* token t is emitted (the hidden state at
  ``prompt_len - 1 + t``, the same position whose logits give ``logps[b, t]``). The episode ends with the last
  valid token, so the state after it is terminal and V(terminal) = 0.
* Padding never influences a valid output, whatever it holds (NaN and ±inf included), and outputs on padding
  are 0 (``masked_whiten`` returns its input there instead).
* Statistics over an empty set are 0, so a micro-batch whose rows are all empty gives a zero loss and zero
  gradient instead of NaN. ``explained_variance`` is the exception: it is undefined there and returns NaN.

The pipeline of one PPO step, with the function that implements each stage (math: docs/ppo.md)::

    r_t   = -β · KL_t(π_old ‖ π_ref) + 1[t = last] · score           kl_shaped_rewards   (Ziegler et al. 2019)
    δ_t   = r_t + γ V_{t+1} - V_t ;  A_t = Σ_l (γλ)^l δ_{t+l}          gae                 (Schulman et al. 2016)
    R_t   = A_t + V_t
    A     ← (A - mean A) / std A   (optional, over valid tokens)       masked_whiten
    L_π   = mean_t max(-A_t ρ_t, -A_t clip(ρ_t, 1-ε, 1+ε))              ppo_policy_loss     (Schulman et al. 2017)
    L_V   = ½ mean_t max((V_t-R_t)², (clip(V_t, V_old±c)-R_t)²)          value_loss
    loss  = L_π + vf_coef · L_V

Knob names and defaults follow TRL's former ``PPOConfig``/``PPOTrainer`` (removed in TRL 1.13 by
huggingface/trl#7020); where our semantics differ from it, the docstring says so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "REWARD_KL_ESTIMATORS",
    "GAEOutput",
    "KLShapedRewards",
    "PPOTargets",
    "PolicyLossOutput",
    "ValueLossOutput",
    "explained_variance",
    "gae",
    "kl_shaped_rewards",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "per_token_kl",
    "ppo_policy_loss",
    "ppo_targets",
    "value_loss",
]

# Estimators of KL(p ‖ q) from tokens sampled from p (Schulman 2020, "Approximating KL Divergence",
# http://joschu.net/blog/kl-approx.html), with log r = log q - log p:
#   k1 = -log r                 unbiased, high variance, can be negative per token
#   k2 = ½ (log r)²             biased, non-negative (TRL's former PPOTrainer logged it as policy/approxkl_avg)
#   k3 = (r - 1) - log r        unbiased, non-negative, lower variance
KL_ESTIMATORS = ("k1", "k2", "k3")
# TRL's former PPOConfig.kl_estimator accepted only these two for the reward penalty (k2 was for logging).
REWARD_KL_ESTIMATORS = ("k1", "k3")


class KLShapedRewards(NamedTuple):
    rewards: Tensor
    """(B, T) per-token rewards: -kl_coef · kl, plus the score on the last valid token; 0 on padding."""
    kl: Tensor
    """(B, T) per-token KL estimate of π_old against π_ref (before multiplying by kl_coef); 0 on padding."""


class GAEOutput(NamedTuple):
    advantages: Tensor
    """(B, T) GAE advantages A_t; 0 on padding."""
    returns: Tensor
    """(B, T) value targets R_t = A_t + V_t; 0 on padding."""


class ValueLossOutput(NamedTuple):
    loss: Tensor
    """Scalar clipped value loss (before vf_coef)."""
    clipfrac: Tensor
    """Scalar fraction of valid tokens where the clipped term is the larger one (it sets the loss)."""


class PolicyLossOutput(NamedTuple):
    loss: Tensor
    """Scalar PPO-clip policy loss."""
    clipfrac: Tensor
    """Scalar fraction of valid tokens where the clipped surrogate is the active one (zero gradient)."""
    approx_kl: Tensor
    """Scalar mean over valid tokens of the KL(π_old ‖ π_θ) estimate (detached)."""


# --------------------------------------------------------------------------------------------------- helpers


def _valid(mask: Tensor, like: Tensor, name: str = "mask") -> Tensor:
    """The mask as bool, after checking that it matches ``like``'s shape."""
    if mask.shape != like.shape:
        raise ValueError(f"`{name}` has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}.")
    return mask.bool()


def _same_shape(tensor: Tensor, like: Tensor, name: str, like_name: str) -> None:
    if tensor.shape != like.shape:
        raise ValueError(
            f"`{name}` has shape {tuple(tensor.shape)} but `{like_name}` has shape {tuple(like.shape)}; "
            "both must be (batch, completion_length)."
        )


def _zero_padding(values: Tensor, valid: Tensor) -> Tensor:
    """``values`` with every padding entry replaced by 0 (``where``, not a product: NaN · 0 is NaN)."""
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """At least float32: the reversed GAE recursion and the statistics lose too much in bf16/fp16."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_fraction(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be in [0, 1], got {value}.")


# --------------------------------------------------------------------------------------- masked statistics


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the valid entries: Σ_t m_t x_t / Σ_t m_t.

    Over all entries (``dim=None``, a scalar) or along ``dim``. An empty selection gives 0 (TRL's former
    ``masked_mean`` divided by zero and returned NaN).
    """
    valid = _valid(mask, values)
    total = _zero_padding(values, valid).sum() if dim is None else _zero_padding(values, valid).sum(dim=dim)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the valid entries (a scalar).

        Var = Σ_t m_t (x_t - x̄)² / (n - 1)      (unbiased, the default, as TRL's former ``masked_var``)
        Var = Σ_t m_t (x_t - x̄)² / n            (``unbiased=False``)

    with n = Σ_t m_t. Where the estimate is undefined (n = 0, or n = 1 when unbiased) it is 0, so that whitening
    a single token gives 0 instead of TRL's NaN.
    """
    valid = _valid(mask, values)
    mean = masked_mean(values, valid)
    squares = _zero_padding((values - mean) ** 2, valid).sum()
    count = valid.sum()
    denominator = (count - 1) if unbiased else count
    return squares / denominator.clamp(min=1).to(squares.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` over the valid entries; padding entries are returned unchanged.

        x̂_t = (x_t - x̄) / √(Var + eps)              (shift_mean=True: mean 0, variance 1)
        x̂_t = (x_t - x̄) / √(Var + eps) + x̄         (shift_mean=False: mean kept, variance 1)

    Var is the *unbiased* masked variance, as TRL's former ``masked_whiten`` (and its predecessor in
    ``trl.core``) used: so the result has unbiased sample variance 1, and we match the reference numerically.
    Over thousands of tokens the choice is immaterial. ``eps`` is TRL's 1e-8. TRL's former PPOTrainer whitened
    advantages with ``shift_mean=True`` and (``whiten_rewards``) rewards with ``shift_mean=False``, so that the
    sign of the mean reward survives.
    """
    valid = _valid(mask, values)
    mean = masked_mean(values, valid)
    var = masked_var(values, valid, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, values)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the variance of the returns that the critic explains, over the valid tokens (a scalar).

        EV = 1 - Var[R - V] / Var[R]

    1 is a perfect critic, 0 one no better than a constant, negative one worse than a constant. The variances are
    the biased (1/n) ones, as CleanRL's ``np.var``; the ratio is the same with Bessel's correction. Where Var[R] is
    0 (all returns equal, one valid token, or none) EV is undefined and this returns NaN, as CleanRL does (TRL's
    former PPOTrainer did not log it). Pass the critic's values *at rollout time* with the returns computed from
    them (CleanRL's ``b_values``, ``b_returns``). Detached.
    """
    _same_shape(values, returns, "values", "returns")
    valid = _valid(mask, returns)
    dtype = _float_dtype(values, returns)
    values, returns = values.detach().to(dtype), returns.detach().to(dtype)
    var_returns = masked_var(returns, valid, unbiased=False)
    var_residual = masked_var(returns - values, valid, unbiased=False)
    ev = 1.0 - var_residual / var_returns
    return torch.where(var_returns == 0, torch.full_like(ev, float("nan")), ev)


# ---------------------------------------------------------------------------------------------- KL rewards


def per_token_kl(logps: Tensor, ref_logps: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(p ‖ q) from tokens sampled from p; (B, T), 0 on padding.

    With log r_t = log q(y_t) - log p(y_t) (``ref_logps - logps``):

        k1 = -log r_t        k2 = ½ (log r_t)²        k3 = (r_t - 1) - log r_t

    (Schulman 2020, "Approximating KL Divergence"). Differentiable in both arguments; the callers detach.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"Unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}.")
    _same_shape(ref_logps, logps, "ref_logps", "logps")
    valid = _valid(mask, logps)
    log_ratio = _zero_padding(ref_logps - logps, valid)  # sanitised first: no inf/NaN reaches exp or its backward
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    else:
        kl = torch.expm1(log_ratio) - log_ratio
    return _zero_padding(kl, valid)


def kl_shaped_rewards(
    scores: Tensor,
    policy_logps: Tensor,
    ref_logps: Tensor,
    mask: Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> KLShapedRewards:
    """Per-token rewards with a KL penalty against the reference policy, and the score on the last token.

        r_t = -β · KL_t + 1[t = last valid token] · score          (β = ``kl_coef``)
        KL_t = log π_old(y_t) - log π_ref(y_t)                      (k1, the default)
        KL_t = (ρ_t - 1) - log ρ_t,  ρ_t = π_ref(y_t) / π_old(y_t)   (k3)

    The KL-shaped reward of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences") and
    Ouyang et al. 2022 (InstructGPT), with TRL's former ``kl_coef`` (0.05) and ``kl_estimator`` ("k1" or "k3").
    ``policy_logps`` are the log-probs of the policy that the KL is measured for: π_old, the policy at rollout
    time. k1 is unbiased for KL(π_old ‖ π_ref) when the tokens were sampled from π_old.

    Args:
        scores: (B,) sequence scores (the summed reward functions, any EOS penalty already applied).
        policy_logps, ref_logps: (B, T) log-probs of the completion tokens.
        mask: (B, T) valid completion tokens (a prefix of each row).
        kl_coef: β ≥ 0.
        kl_estimator: "k1" or "k3".

    Returns:
        ``KLShapedRewards(rewards, kl)``, both (B, T), 0 on padding, detached. ``kl`` is the per-token estimate
        before β: ``(kl.sum(-1)).mean()`` is TRL's former ``objective/kl``. An empty row gets no reward at all: it
        has no token to carry its score.

    Differs from TRL's former PPOTrainer, which added the score one position *after* the last token (on the first
    padding slot, whose critic value it kept in the value loss) whenever that slot existed. Here the episode ends
    with the last valid token, so the score is that token's reward and V after it is 0.
    """
    if kl_estimator not in REWARD_KL_ESTIMATORS:
        raise ValueError(
            f"`kl_estimator` must be one of {REWARD_KL_ESTIMATORS} (TRL's former PPOConfig choices), got "
            f"{kl_estimator!r}."
        )
    if kl_coef < 0:
        raise ValueError(f"`kl_coef` must be >= 0, got {kl_coef}.")
    _same_shape(ref_logps, policy_logps, "ref_logps", "policy_logps")
    valid = _valid(mask, policy_logps)
    if scores.shape != policy_logps.shape[:1]:
        raise ValueError(f"`scores` must have shape ({policy_logps.shape[0]},), got {tuple(scores.shape)}.")
    dtype = _float_dtype(policy_logps, ref_logps, scores)
    kl = per_token_kl(policy_logps.detach().to(dtype), ref_logps.detach().to(dtype), valid, kl_estimator)
    lengths = valid.sum(dim=-1, keepdim=True)
    positions = torch.arange(valid.shape[-1], device=valid.device)
    is_last = (positions == lengths - 1) & valid  # the prefix property makes this the last valid token
    score_column = scores.detach().to(dtype).unsqueeze(-1)
    rewards = -kl_coef * kl + torch.where(is_last, score_column, torch.zeros((), dtype=dtype, device=kl.device))
    return KLShapedRewards(rewards=_zero_padding(rewards, valid), kl=kl)


# ------------------------------------------------------------------------------------------------------ GAE


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> GAEOutput:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eqs. 11-16) and returns.

        δ_t = r_t + γ V_{t+1} - V_t            with V_{t+1} = 0 after the last valid token (terminal)
        A_t = Σ_{l≥0} (γλ)^l δ_{t+l}  =  δ_t + γλ A_{t+1}      (the sum stops at the last valid token)
        R_t = A_t + V_t                         (the value target; the λ-return)

    λ = 0 gives TD(0), A_t = δ_t; λ = 1 gives the Monte-Carlo return minus V, A_t = Σ_l γ^l r_{t+l} - V_t.
    TRL's former defaults: γ = ``gamma`` = 1.0, λ = ``lam`` = 0.95.

    Vectorised over the batch, a reversed loop over T. Inputs are detached (advantages and returns are targets,
    never differentiated) and the recursion runs in at least float32. Advantages and returns are 0 on padding.
    Whitening the advantages is left to the caller (``masked_whiten``).
    """
    _check_fraction(gamma, "gamma")
    _check_fraction(lam, "lam")
    _same_shape(values, rewards, "values", "rewards")
    valid = _valid(mask, rewards)
    dtype = _float_dtype(rewards, values)
    rewards = _zero_padding(rewards.detach().to(dtype), valid)
    values = _zero_padding(values.detach().to(dtype), valid)
    # Zero values on padding make V_{t+1} = 0 after the last valid token: valid tokens are a prefix.
    next_values = torch.nn.functional.pad(values[..., 1:], (0, 1))
    deltas = _zero_padding(rewards + gamma * next_values - values, valid)
    advantages = torch.empty_like(deltas)
    running = torch.zeros_like(deltas[..., 0])
    for t in reversed(range(deltas.shape[-1])):
        # Padding has δ = 0 and comes after the valid tokens, so `running` is still 0 at each row's last token.
        running = deltas[..., t] + (gamma * lam) * running
        advantages[..., t] = running
    returns = _zero_padding(advantages + values, valid)
    return GAEOutput(advantages=advantages, returns=returns)


# --------------------------------------------------------------------------------------------------- losses


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float | None,
    normalizer: Tensor | float | None = None,
) -> ValueLossOutput:
    """PPO's clipped value loss (as in OpenAI baselines' ppo2 and TRL's former PPOTrainer).

        V^clip_t = clip(V_t, V^old_t - c, V^old_t + c)                  (c = ``cliprange_value``)
        L_V = ½ · (1/N) Σ_t m_t · max((V_t - R_t)², (V^clip_t - R_t)²)

    N is the number of valid tokens in ``mask`` (a token-level mean, as TRL's former ``0.5 * masked_mean``), or
    ``normalizer`` when given (e.g. the valid-token count of the whole optimizer batch, to match TRL's GRPO
    normalisation under gradient accumulation). ``cliprange_value=None`` gives the unclipped ½ (V - R)².
    Gradient flows through ``values`` only. The trainer multiplies by ``vf_coef`` (TRL's 0.1).

    Returns ``ValueLossOutput(loss, clipfrac)``; clipfrac is the fraction of valid tokens where the clipped
    square is strictly larger (TRL's ``val/clipfrac_avg``), detached.
    """
    if cliprange_value is not None and cliprange_value <= 0:
        raise ValueError(f"`cliprange_value` must be > 0 (or None for no clipping), got {cliprange_value}.")
    _same_shape(old_values, values, "old_values", "values")
    _same_shape(returns, values, "returns", "values")
    valid = _valid(mask, values)
    values = _zero_padding(values, valid)
    old_values = _zero_padding(old_values.detach().to(values.dtype), valid)
    returns = _zero_padding(returns.detach().to(values.dtype), valid)
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        per_token = unclipped
        clipped_active = torch.zeros_like(valid)
    else:
        clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = (clipped > unclipped) & valid
    loss = 0.5 * _normalised_sum(per_token, valid, normalizer)
    clipfrac = masked_mean(clipped_active.to(values.dtype), valid).detach()
    return ValueLossOutput(loss=loss, clipfrac=clipfrac)


def ppo_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    *,
    importance_weights: Tensor | None = None,
    approx_kl_estimator: str = "k3",
    normalizer: Tensor | float | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate loss (Schulman et al. 2017, arXiv:1707.06347, eq. 7), per token.

        ρ_t = π_θ(y_t) / π_old(y_t)
        ℓ_t = max(-A_t ρ_t, -A_t clip(ρ_t, 1 - ε, 1 + ε))                    (ε = ``cliprange``)
        L_π = (1/N) Σ_t m_t · w_t · ℓ_t

    N is the number of valid tokens (TRL's former ``masked_mean(pg_loss_max, ~padding_mask)``) or ``normalizer``
    when given. Gradient flows through ``logps`` only.

    **Importance correction against the behaviour policy μ** (``importance_weights`` given): rows from the async
    queue were sampled by μ, an older policy than π_old, and the per-token loss is multiplied by the truncated
    importance weight w = π_old / μ, (B, T) per token or (B, 1) per sequence, as GRPO's TRL losses are
    (``trl_async.trainers.correction`` computes it, TRL 1.16's ``vllm_importance_sampling_*`` semantics). Without
    ``importance_weights``, w = 1.

    Returns ``PolicyLossOutput(loss, clipfrac, approx_kl)``, the last two detached and unweighted by w:
      * clipfrac: fraction of valid tokens whose clipped term is strictly larger (TRL's ``policy/clipfrac_avg``;
        those tokens have zero gradient).
      * approx_kl: masked mean of the estimate of KL(π_old ‖ π_θ) (``per_token_kl(old_logps, logps)``), default
        k3 = (ρ - 1) - log ρ (CleanRL's ``approx_kl``: unbiased and never negative). TRL's former PPOTrainer logged
        k2 = ½ (log ρ)², averaged over padding too.
    """
    if cliprange <= 0:
        raise ValueError(f"`cliprange` must be > 0, got {cliprange}.")
    if approx_kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"`approx_kl_estimator` must be one of {KL_ESTIMATORS}, got {approx_kl_estimator!r}.")
    _same_shape(old_logps, logps, "old_logps", "logps")
    _same_shape(advantages, logps, "advantages", "logps")
    valid = _valid(mask, logps)
    old_logps = old_logps.detach().to(logps.dtype)
    log_ratio = _zero_padding(logps - old_logps, valid)  # sanitised before exp: padding may hold ±inf
    ratio = torch.exp(log_ratio)
    advantages = _zero_padding(advantages.detach().to(logps.dtype), valid)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.maximum(unclipped, clipped)
    if importance_weights is not None:
        if importance_weights.shape not in (logps.shape, (logps.size(0), 1)):
            raise ValueError(
                f"`importance_weights` must have shape {tuple(logps.shape)} or ({logps.size(0)}, 1), got "
                f"{tuple(importance_weights.shape)}."
            )
        per_token = per_token * importance_weights.detach().to(logps.dtype)
    loss = _normalised_sum(per_token, valid, normalizer)
    clipfrac = masked_mean(((clipped > unclipped) & valid).to(logps.dtype), valid).detach()
    kl = per_token_kl(old_logps, logps.detach(), valid, approx_kl_estimator)
    approx_kl = masked_mean(kl, valid)
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


def _normalised_sum(per_token: Tensor, valid: Tensor, normalizer: Tensor | float | None) -> Tensor:
    """Σ_t m_t ℓ_t / N, with N the valid-token count (at least 1) or the given normaliser."""
    total = _zero_padding(per_token, valid).sum()
    if normalizer is None:
        return total / valid.sum().clamp(min=1).to(total.dtype)
    return total / normalizer


# The knobs `ppo_targets` takes from a PPO config, under the config's names (`AsyncPPOConfig`).
PPO_TARGET_KNOBS = ("kl_coef", "kl_estimator", "gamma", "lam", "whiten_rewards", "whiten_advantages")


class PPOTargets(NamedTuple):
    advantages: Tensor  # (B, T) GAE advantages, whitened over the valid tokens if asked; 0 on padding
    returns: Tensor  # (B, T) value targets R_t = A_t + V_t (before whitening A); 0 on padding
    rewards: Tensor  # (B, T) KL-shaped per-token rewards (before whitening); 0 on padding
    kl: Tensor  # (B, T) per-token KL estimate of π_old against π_ref (before kl_coef); 0 on padding


def ppo_targets(
    scores: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor,
    old_values: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    whiten_rewards: bool,
    whiten_advantages: bool,
) -> PPOTargets:
    """PPO's targets for one rollout batch (the stages of `ppo_math`, in TRL's former PPOTrainer's order):

    r_t = -kl_coef · KL_t(π_old ‖ π_ref) + 1[t = last] · score                 (kl_shaped_rewards)
    r   ← whiten(r), mean kept                                                 (if whiten_rewards)
    A_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ V_{t+1} - V_t,  R_t = A_t + V_t     (gae)
    A   ← whiten(A)                                                            (if whiten_advantages)
    """
    shaped = kl_shaped_rewards(scores, old_logps, ref_logps, mask, kl_coef, kl_estimator)
    rewards = masked_whiten(shaped.rewards, mask, shift_mean=False) if whiten_rewards else shaped.rewards
    advantages, returns = gae(rewards, old_values, mask, gamma, lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask, shift_mean=True)
    return PPOTargets(advantages=advantages, returns=returns, rewards=shaped.rewards, kl=shaped.kl)
