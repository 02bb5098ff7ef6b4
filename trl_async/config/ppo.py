"""`AsyncPPOConfig`: the configuration of `AsyncPPOTrainer` (PPO with a learned critic; docs/ppo.md).

A real config: its own fields with their own validation (`validate_ppo_fields`), the engine's async and M2PO fields
(`config.validate_async_fields`, with PPO's loss types), and TRL's `GRPOConfig` post-init for the rest, which
`GRPOTrainer`, the base of both trainers, reads (`trl_contract.finish_grpo_config`). That one leaves out TRL's check
`num_generations >= 2`: GRPO's group baseline needs two completions per prompt, PPO's baseline is the critic.
`kl_coef` sets TRL's `beta`, which switches TRL's reference log-probs on (PPO puts the KL into the reward, not the
loss). Knob names and defaults are those of TRL's former `PPOConfig` (removed in TRL 1.13).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..trl_contract import finish_grpo_config
from .grpo import AsyncGRPOConfig, _check, ensure_async_fields

PPO_LOSS_TYPES = ("ppo", "m2po")
PPO_KL_ESTIMATORS = ("k1", "k3")


@dataclass
class AsyncPPOConfig(AsyncGRPOConfig):
    r"""
    [`AsyncGRPOConfig`] plus the PPO parameters of [`AsyncPPOTrainer`]: a learned critic, KL-shaped per-token rewards
    and GAE (math and sources: docs/ppo.md).

    PPO's former TRL knobs map onto the GRPO schedule: `num_ppo_epochs` is `num_iterations`, `num_mini_batches` is
    `steps_per_generation`. `kl_coef` sets `beta` (TRL then computes the reference log-probs: a reference model, or
    the disabled adapter under PEFT), but PPO puts the KL into the reward, not into the loss. GRPO-only settings that
    PPO does not read: `scale_rewards`, `epsilon` (PPO's clip is `cliprange`).
    """

    num_generations: int | None = field(
        default=1,
        metadata={
            "help": "Completions per prompt. PPO needs no group of samples (the critic is the baseline), so 1 is the "
            "default; more give more rows per prompt."
        },
    )
    loss_type: str = field(
        default="ppo",
        metadata={
            "help": "Policy loss. 'ppo': PPO's clipped surrogate (Schulman et al. 2017) with the truncated importance "
            "weight π_old/μ against the behaviour policy for stale rows. 'm2po': M2PO's second-moment trust region "
            "against μ (Zheng et al. 2025; m2po_threshold, m2po_rule, per micro-batch)."
        },
    )
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss in the total loss."})
    cliprange: float = field(
        default=0.2, metadata={"help": "ε of PPO's clipped surrogate: the ratio π_θ/π_old is clipped to [1-ε, 1+ε]."}
    )
    cliprange_value: float | None = field(
        default=0.2,
        metadata={
            "help": "Value clipping: the new value is clipped to old value ± cliprange_value in the value loss. "
            "None: no clipping."
        },
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor γ of GAE, in [0, 1]."})
    lam: float = field(default=0.95, metadata={"help": "λ of GAE, in [0, 1] (0: TD(0), 1: Monte-Carlo returns)."})
    kl_coef: float = field(
        default=0.05,
        metadata={"help": "β of the KL-shaped per-token reward -β·KL(π_old ‖ π_ref). 0 disables the reference model."},
    )
    kl_estimator: str = field(
        default="k1",
        metadata={"help": "Estimator of the per-token KL in the reward: 'k1' (log-ratio) or 'k3' (Schulman 2020)."},
    )
    whiten_rewards: bool = field(
        default=False,
        metadata={"help": "Whiten the per-token rewards (mean kept) over the batch before GAE."},
    )
    whiten_advantages: bool = field(
        default=True,
        metadata={"help": "Whiten the advantages over the batch's valid tokens (TRL's former PPOTrainer always did)."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Subtracted from the score of every completion that ends without an EOS token (truncated at "
            "max_completion_length). None: no penalty."
        },
    )
    critic_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the critic's own parameters (the value model, or the value head and value "
            "adapter under PEFT). None: learning_rate. The scheduler applies to both."
        },
    )

    def __post_init__(self):
        _check(
            self.kl_coef is not None and self.kl_coef >= 0,
            f"kl_coef must be >= 0 (0 disables the KL penalty), got {self.kl_coef!r}.",
        )
        _check(
            self.beta in (0.0, self.kl_coef),
            f"beta={self.beta!r} is GRPO's KL-loss coefficient; AsyncPPOConfig puts the KL into the reward with "
            f"kl_coef (beta follows it). Leave beta unset and set kl_coef instead.",
        )
        self.beta = self.kl_coef  # TRL computes the reference log-probs iff beta != 0
        _check(
            isinstance(self.num_generations, int) and self.num_generations >= 1,
            f"num_generations must be an integer >= 1 (completions per prompt), got {self.num_generations!r}.",
        )
        finish_grpo_config(self, require_groups=False)
        validate_ppo_fields(self)
        ensure_async_fields(self, PPO_LOSS_TYPES)


def validate_ppo_fields(args) -> None:
    """Validate the PPO fields and refuse GRPO loss options that the PPO loss does not implement."""
    _check(
        args.loss_type in PPO_LOSS_TYPES,
        f"loss_type={args.loss_type!r} is not a PPO loss. Use one of {list(PPO_LOSS_TYPES)} (the GRPO loss types "
        "belong to AsyncGRPOTrainer).",
    )
    _check(args.vf_coef is not None and args.vf_coef >= 0, f"vf_coef must be >= 0, got {args.vf_coef!r}.")
    _check(
        args.cliprange is not None and args.cliprange > 0,
        f"cliprange must be > 0 (PPO's ε, TRL's default 0.2), got {args.cliprange!r}.",
    )
    _check(
        args.cliprange_value is None or args.cliprange_value > 0,
        f"cliprange_value must be > 0, or None for an unclipped value loss, got {args.cliprange_value!r}.",
    )
    for name in ("gamma", "lam"):
        value = getattr(args, name)
        _check(value is not None and 0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value!r}.")
    _check(
        args.kl_estimator in PPO_KL_ESTIMATORS,
        f"kl_estimator={args.kl_estimator!r} is unknown. Use one of {list(PPO_KL_ESTIMATORS)}.",
    )
    _check(
        args.missing_eos_penalty is None or args.missing_eos_penalty >= 0,
        f"missing_eos_penalty must be >= 0 (it is subtracted from the score), or None, got "
        f"{args.missing_eos_penalty!r}.",
    )
    _check(
        args.critic_learning_rate is None or args.critic_learning_rate > 0,
        f"critic_learning_rate must be > 0, or None to use learning_rate, got {args.critic_learning_rate!r}.",
    )
    if args.loss_type == "m2po":
        _check(
            args.m2po_scope == "micro_batch",
            "AsyncPPOConfig selects M2PO tokens per micro-batch; use m2po_scope='micro_batch'.",
        )
    unsupported = {
        "top_entropy_quantile < 1": args.top_entropy_quantile < 1.0,
        "entropy_coef != 0": bool(args.entropy_coef),
        "use_adaptive_entropy=True": bool(args.use_adaptive_entropy),
        "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        "importance_sampling_level='sequence'": args.importance_sampling_level != "token",
        "delta": args.delta is not None,
        "epsilon_high (PPO's clip is cliprange)": args.epsilon_high is not None,
        "multi_objective_aggregation='normalize_then_sum' (PPO scores the weighted sum of the rewards)": (
            args.multi_objective_aggregation != "sum_then_normalize"
        ),
        "use_vllm=True": bool(args.use_vllm),
    }
    used = [name for name, on in unsupported.items() if on]
    _check(not used, f"AsyncPPOConfig does not support {', '.join(used)}: these belong to GRPO's loss. Unset them.")
