"""Configuration for the asynchronous trainers.

`AsyncGRPOConfig` is TRL's `GRPOConfig` plus the knobs of the asynchronous engine and of M2PO. A plain
`trl.GRPOConfig` also works with `AsyncGRPOTrainer`: `ensure_async_fields` fills in the defaults below.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from trl import GRPOConfig

from .losses import M2PO_RULES, M2PO_SCOPES
from .rollout.queue import last_use_version

logger = logging.getLogger(__name__)

GENERATION_BACKENDS = ("hf", "vllm")
M2PO_VARIANTS = ("m2po", "reference_page")
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LOSS_TYPES = (*TRL_LOSS_TYPES, "m2po")


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    r"""
    [`~trl.GRPOConfig`] plus the asynchronous-generation and M2PO parameters of [`AsyncGRPOTrainer`].

    Staleness of a row is the trainer's policy version (optimizer steps taken) when the row enters a loss, minus the
    version of the weights that generated it. The generator is gated so that it never produces a row that would be
    older than `max_staleness` when used, and any row that still is gets evicted, never trained on.
    """

    # --- asynchronous generation -------------------------------------------------------------------------------
    async_generation: bool = field(
        default=True,
        metadata={
            "help": "Generate rollouts in a background process per rank while the trainer trains. False runs TRL's "
            "synchronous generation in the training process (useful for debugging and A/B runs)."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Largest staleness (in optimizer steps) a row may have when it enters a loss. 0 is on-policy "
            "(generation waits for every update). Default (None): the smallest value that lets the generator produce "
            "the next generation batch while the trainer trains on the current one: 1 when each generation batch is "
            "used within one optimizer step (TRL's default schedule), more when the schedule trains on a batch across "
            "several optimizer steps (steps_per_generation > gradient_accumulation_steps, or num_iterations > 1)."
        },
    )
    queue_capacity: int | None = field(
        default=None,
        metadata={
            "help": "Most generation batches the generator may have queued or in flight. Default: derived, the "
            "number of batches the staleness bound can admit, (max_staleness + 1) * gradient_accumulation_steps / "
            "(steps_per_generation * num_iterations), rounded up."
        },
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={
            "help": "Publish the policy weights to the generator every this many optimizer steps. Must be at most "
            "max_staleness + 1, otherwise the generator could never get weights recent enough."
        },
    )
    generation_backend: str = field(
        default="hf",
        metadata={
            "help": "Generation backend of the background process: 'hf' (transformers `generate`) or 'vllm' (vLLM, "
            "see docs/vllm.md): with TRL's `vllm_mode='colocate'` an engine inside each generation process, with "
            "`vllm_mode='server'` a running server (`vllm_server_*`). TRL's `use_vllm=True` selects 'vllm'."
        },
    )
    generation_device: str | None = field(
        default=None,
        metadata={
            "help": "Device of the generation process, e.g. 'cpu' or 'cuda:1'. Default: the device accelerate "
            "gives this rank."
        },
    )
    generation_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch CPU threads of the generation process. Default: half of this rank's thread budget (at "
            "least 1): OMP_NUM_THREADS, else a torch.set_num_threads made before training, else the rank's CPU cores. "
            "When both processes compute on the CPU, the trainer keeps the rest of the budget (at least 1)."
        },
    )
    lend_idle_cores: bool = field(
        default=True,
        metadata={
            "help": "When the trainer and the generation process split a rank's thread budget (both on CPU, a "
            "budget of 2 or more threads), lend a waiting process's share to the other: the trainer computes on the "
            "whole budget while the generator waits at the staleness gate, the generator while the trainer waits on "
            "the queue (see trl_async/rollout/cores.py). False: each keeps its fixed share. Ignored with the vLLM "
            "backend."
        },
    )
    trainer_generates_while_starting: bool = field(
        default=True,
        metadata={
            "help": "While the generation process starts (spawn, imports, model build: seconds), the trainer produces "
            "the first generation batches itself, with the same code and the same per-batch seeds, so training never "
            "waits for a cold generator; it switches to the queue as soon as the generation process is ready. False: "
            "the trainer waits for the generation process instead. Ignored (False) under FSDP2 / ZeRO-3, where "
            "generating on the sharded model would gather it at every decoding step."
        },
    )
    generator_startup_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds to wait for the generation process to load its model and report ready."},
    )
    generator_heartbeat_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Seconds without any sign of progress from the generation process after which the trainer "
            "stops with an error instead of waiting forever. The generator beats at every generated token."
        },
    )

    # --- training forward --------------------------------------------------------------------------------------
    shared_prompt_forward: str = field(
        default="auto",
        metadata={
            "help": "Compute each prompt once per group in the training forward instead of once per completion "
            "(trl_async/shared_prompt.py), with the log-probs and gradients of TRL's forward: the rows of a group are "
            "packed into one sequence, each completion attending to the shared prompt and to itself; where that "
            "saves under 20% of the tokens (long completions), the prompts run once as a key/value prefix that the "
            "completions read (single-process training only). 'auto': on when the trainer computes on the CPU, "
            "where the forward's cost is its tokens (on a GPU the dense mask it needs keeps attention off the "
            "fastest kernels; not measured there). 'on': wherever possible. 'off': TRL's forward. Needs sdpa or eager "
            "attention and a text-only batch; otherwise, or when neither saves enough, TRL's forward runs."
        },
    )

    # --- M2PO ----------------------------------------------------------------------------------------------------
    m2po_threshold: float = field(
        default=0.04,
        metadata={
            "help": "τ_M2 of M2PO (Zheng et al. 2025, 0.04 in the paper): the bound on the mean squared log importance "
            "ratio δ² = (log π_θ − log μ)²; m2po_rule says which tokens it constrains."
        },
    )
    m2po_rule: str = field(
        default="paper",
        metadata={
            "help": "Which M2PO rule (docs/m2po.md). 'paper': Algorithm 1 of Zheng et al. 2025 (arXiv 2510.01161), as "
            "ms-swift PR #9965 and Trinity-RFT PR #616 implement it: only trust-region tokens ((A>0 and r>1) or (A<0 "
            "and r<1)) are candidates; the largest δ² are masked until their mean is ≤ m2po_threshold; no ε-clip. "
            "'all_tokens': every valid token is a candidate (AReaL PR #480); a micro-batch whose every token breaks "
            "the bound is skipped and counted. 'authors_code': the authors' training code (Infini-AI-Lab/M2PO "
            "verl/trainer/ppo/core_algos.py), which produced the paper's numbers: a PPO clip exp(±τ_c) whose cut "
            "keeps the harmful tokens' capped mean δ² ≤ m2po_threshold; no clip when the budget holds."
        },
    )
    m2po_scope: str = field(
        default="micro_batch",
        metadata={
            "help": "Over which tokens M2PO selects. 'micro_batch': one rank's micro-batch (the authors' code, AReaL). "
            "'global': the whole optimizer batch across data-parallel ranks (ms-swift, Trinity-RFT): two small "
            "all_gathers per optimizer step; needs gradient_accumulation_steps=1 (as ms-swift's Hugging Face path)."
        },
    )
    m2po_clip_floor_low: float | None = field(
        default=None,
        metadata={
            "help": "m2po_rule='authors_code' only: the authors' optional miniclip_low (their function default 0.3; "
            "no shipped script sets it). The clip's lower ratio bound is at most 1 − low. None = off."
        },
    )
    m2po_clip_floor_high: float | None = field(
        default=None,
        metadata={
            "help": "m2po_rule='authors_code' only: the authors' optional miniclip_high (their function default 0.5; "
            "no shipped script sets it). The clip's upper ratio bound is at least 1 + high. None = off."
        },
    )
    m2po_variant: str = field(
        default="m2po",
        metadata={
            "help": "'m2po': the published M2PO family (m2po_rule picks the rule). 'reference_page': the per-token rule "
            "r² ≤ m2po_gamma inside the PPO clip, as printed on the AsyncTensorRLHF page; not the published M2PO, "
            "kept only to reproduce that page's figures side by side."
        },
    )
    m2po_gamma: float = field(
        default=2.0,
        metadata={"help": "γ of m2po_variant='reference_page': a token is kept when r² ≤ γ."},
    )

    def __post_init__(self):
        super().__post_init__()
        ensure_async_fields(self)


ASYNC_FIELDS = tuple(
    f for f in dataclasses.fields(AsyncGRPOConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
)


def async_field(args, name: str):
    """An async/M2PO field of `args`, or its default when `args` lacks it (a plain `GRPOConfig`, a namespace)."""
    return getattr(args, name, _ASYNC_DEFAULTS[name])


_ASYNC_DEFAULTS = {f.name: f.default for f in ASYNC_FIELDS}


def ensure_async_fields(args: GRPOConfig) -> GRPOConfig:
    """Give a plain `GRPOConfig` the async defaults (in place), resolve `max_staleness=None`, and validate.

    A value the user set explicitly is validated as given: too small a `max_staleness` for the schedule is an error.
    Only an unset one (`None`, or absent from a plain `GRPOConfig`) is derived from the schedule, and logged.
    """
    for f in ASYNC_FIELDS:
        if not hasattr(args, f.name):
            setattr(args, f.name, f.default)
    if args.max_staleness is None and getattr(args, "gradient_accumulation_steps", None) is not None:
        args.max_staleness = default_max_staleness(args)
        logger.info(
            "trl_async: max_staleness=%d (derived from the schedule: each generation batch is trained on across %d "
            "optimizer step(s)); set it in AsyncGRPOConfig to choose another bound.",
            args.max_staleness,
            usage_span(args) + 1,
        )
    validate_async_fields(args)
    return args


def default_max_staleness(args) -> int:
    """The smallest bound that lets batch n+1 be generated while batch n trains: its usage span plus one."""
    return usage_span(args) + 1


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_async_fields(args) -> None:
    """Validate the async and M2PO fields, and their consistency with TRL's batch geometry."""
    _check(
        args.loss_type in LOSS_TYPES,
        f"loss_type={args.loss_type!r} is unknown. Use one of {list(LOSS_TYPES)}.",
    )
    _check(
        args.max_staleness is None or (isinstance(args.max_staleness, int) and args.max_staleness >= 0),
        f"max_staleness must be None (derived from the schedule) or an integer >= 0 (0 = on-policy), got "
        f"{args.max_staleness!r}.",
    )
    _check(
        isinstance(args.weight_sync_steps, int) and args.weight_sync_steps >= 1,
        f"weight_sync_steps must be an integer >= 1, got {args.weight_sync_steps!r}.",
    )
    _check(
        args.generation_backend in GENERATION_BACKENDS,
        f"generation_backend={args.generation_backend!r} is unknown. Use one of {list(GENERATION_BACKENDS)}.",
    )
    _check(
        args.queue_capacity is None or (isinstance(args.queue_capacity, int) and args.queue_capacity >= 1),
        f"queue_capacity must be None (derived) or an integer >= 1, got {args.queue_capacity!r}.",
    )
    _check(
        args.generation_num_threads is None
        or (isinstance(args.generation_num_threads, int) and args.generation_num_threads >= 1),
        f"generation_num_threads must be None (auto) or an integer >= 1, got {args.generation_num_threads!r}.",
    )
    _check(
        args.shared_prompt_forward in ("auto", "on", "off"),
        f"shared_prompt_forward must be 'auto', 'on' or 'off', got {args.shared_prompt_forward!r}.",
    )
    for name in ("generator_startup_timeout", "generator_heartbeat_timeout"):
        value = getattr(args, name)
        _check(value is not None and value > 0, f"{name} must be a positive number of seconds, got {value!r}.")
    _check(
        args.m2po_threshold is not None and args.m2po_threshold > 0,
        f"m2po_threshold must be > 0 (τ_M2, the paper uses 0.04), got {args.m2po_threshold!r}.",
    )
    _check(
        args.m2po_variant in M2PO_VARIANTS,
        f"m2po_variant={args.m2po_variant!r} is unknown. Use 'm2po' (the published M2PO, rule set by m2po_rule) or "
        "'reference_page' (the AsyncTensorRLHF page's token rule).",
    )
    _check(
        args.m2po_rule in M2PO_RULES,
        f"m2po_rule={args.m2po_rule!r} is unknown. Use 'paper' (Algorithm 1, the default), 'all_tokens' (AReaL's "
        "candidate set) or 'authors_code' (the authors' training code); see docs/m2po.md.",
    )
    _check(
        args.m2po_scope in M2PO_SCOPES,
        f"m2po_scope={args.m2po_scope!r} is unknown. Use 'micro_batch' or 'global'.",
    )
    low, high = args.m2po_clip_floor_low, args.m2po_clip_floor_high
    _check(low is None or 0 <= low < 1, f"m2po_clip_floor_low must be None or in [0, 1), got {low!r}.")
    _check(high is None or high >= 0, f"m2po_clip_floor_high must be None or >= 0, got {high!r}.")
    _check(
        (low is None and high is None) or args.m2po_rule == "authors_code",
        "m2po_clip_floor_low/high apply to m2po_rule='authors_code' only; unset them or set m2po_rule='authors_code'.",
    )
    if args.loss_type == "m2po" and args.m2po_scope == "global":
        _check(
            args.m2po_variant == "m2po",
            "m2po_scope='global' applies to m2po_variant='m2po' only; use m2po_scope='micro_batch'.",
        )
        _check(
            getattr(args, "gradient_accumulation_steps", 1) == 1,
            "m2po_scope='global' selects over the whole optimizer batch and needs gradient_accumulation_steps=1 "
            "(raise per_device_train_batch_size instead), or use m2po_scope='micro_batch'.",
        )
    _check(args.m2po_gamma is not None and args.m2po_gamma > 0, f"m2po_gamma must be > 0, got {args.m2po_gamma!r}.")

    if args.async_generation and args.max_staleness is not None:
        span = usage_span(args)
        _check(
            span <= args.max_staleness,
            f"Each generation batch is trained on across {span + 1} optimizer steps (steps_per_generation="
            f"{args.steps_per_generation}, num_iterations={args.num_iterations}, gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}), so its rows reach staleness {span} even when fresh. Set "
            f"max_staleness >= {span}.",
        )
        _check(
            args.weight_sync_steps <= args.max_staleness + 1 - span,
            f"weight_sync_steps={args.weight_sync_steps} cannot keep rows within max_staleness="
            f"{args.max_staleness}: the generator would wait for weights that are never published. Set "
            f"weight_sync_steps <= {args.max_staleness + 1 - span} or raise max_staleness.",
        )


def micro_steps_per_generation(args) -> int:
    """How many training micro-steps one generation batch feeds (TRL's `generate_every`)."""
    return args.steps_per_generation * args.num_iterations


def first_and_last_use(index: int, args, base_version: int = 0) -> tuple[int, int]:
    """Policy versions at which generation batch `index` first and last enters a loss.

    TRL generates at micro-steps 0, g, 2g, ... (g = steps_per_generation * num_iterations) and takes an optimizer step
    every `gradient_accumulation_steps` micro-steps, so batch n is used at micro-steps [n g, n g + g - 1].
    """
    g, a = micro_steps_per_generation(args), args.gradient_accumulation_steps
    return base_version + (index * g) // a, last_use_version(index, g, a, base_version)


def usage_span(args) -> int:
    """Most optimizer steps between the first and last use of one generation batch (the schedule repeats every a)."""
    return max(
        last - first for first, last in (first_and_last_use(n, args) for n in range(args.gradient_accumulation_steps))
    )


# =====================================================================================================================
# AsyncPPOConfig: PPO with a learned critic (the trainer is `trl_async.ppo.AsyncPPOTrainer`, the math
# `trl_async.ppo_math`, docs/ppo.md). Knob names and defaults are those of TRL's former `PPOConfig` (removed in TRL 1.13).
# =====================================================================================================================

PPO_LOSS_TYPES = ("ppo", "m2po")
PPO_KL_ESTIMATORS = ("k1", "k3")
# The GRPO loss type the engine's validation and TRL's `GRPOTrainer.__init__` see while `loss_type="ppo"` (which they
# do not know): "dapo", TRL's default, whose clipped surrogate and token normalisation are PPO's. Nothing else reads it.
_GRPO_STAND_IN_FOR_PPO = "dapo"


class _OneGeneration(int):
    """The integer 1, for the length of `GRPOConfig.__post_init__` only. TRL rejects `num_generations < 2` because
    GRPO's group baseline needs two samples per prompt; PPO's baseline is the critic, so one sample per prompt is
    enough. Arithmetic (the divisibility checks) sees 1; only that one comparison is answered as for 2."""

    def __lt__(self, other):
        return 2 < other


class grpo_view_of_ppo_args:  # noqa: N801 (a context manager, used like a function)
    """`with grpo_view_of_ppo_args(args):` while the block runs, `args.loss_type` reads as a GRPO loss type when it
    is "ppo", so that the engine's `validate_async_fields` (GRPO's loss types) and `GRPOTrainer.__init__` accept a
    PPO config. Restored on exit, whatever happens."""

    def __init__(self, args):
        self.args = args
        self.loss_type = args.loss_type

    def __enter__(self):
        if self.loss_type == "ppo":
            self.args.loss_type = _GRPO_STAND_IN_FOR_PPO
        return self.args

    def __exit__(self, *exc):
        self.args.loss_type = self.loss_type
        return False


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
        single = self.num_generations == 1
        if single:
            self.num_generations = _OneGeneration(1)
        try:
            with grpo_view_of_ppo_args(self):
                super().__post_init__()
        finally:
            if single:
                self.num_generations = 1
        validate_ppo_fields(self)


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
            args.m2po_variant == "m2po",
            f"m2po_variant={args.m2po_variant!r} is not available with AsyncPPOConfig; use m2po_variant='m2po' "
            "(the published M2PO; m2po_rule picks its rule).",
        )
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
