"""Configuration for the asynchronous trainers.

`AsyncGRPOConfig` is TRL's `GRPOConfig` plus the knobs of the asynchronous engine and of M2PO. A plain
`trl.GRPOConfig` also works with `AsyncGRPOTrainer`: `ensure_async_fields` fills in the defaults below.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..algorithms.m2po import M2PO_RULES, M2PO_SCOPES
from ..schedule import items_per_decode_within, pipelined_max_staleness, usage_span

logger = logging.getLogger(__name__)

GENERATION_BACKENDS = ("hf", "vllm")
CUDA_GRAPH_SETTINGS = ("auto", "on", "off")
# `max_rows_per_decode="auto"`: the most rows one decode holds. On one H200 a 0.5B model's decode of 32 rows is bound by
# kernel launches (SM 10-25% busy), so a call of several batches costs little more than one; on 2 CPU cores the 0.5B
# shape decodes 32 rows at 2x the rows/s of 8 and 64 at 2.2x, the bundled model 256 at 1.6x the rows/s of 64
# (docs/staleness.md#rows-per-decode). Beyond a few hundred rows the KV cache, not the launches, sets the cost.
AUTO_MAX_ROWS_PER_DECODE = 256
# With `max_staleness` and `max_rows_per_decode` both left to their defaults, the bound is made for one generation
# batch per decode (batch n+1 generated while batch n trains, the bound since wave 1), whatever the loss: blocks of 2
# (bound 3) cost the main job (M2PO) held-out accuracy, async - sync -0.049 +- 0.020 over 12 seeds (95% interval
# [-0.094, -0.004], benchmarks/results/bench_main_job_seeds_block2.json), where TRL's loss with its correction
# already fell at a fixed staleness of 2 to 4 (docs/staleness.md#rows-per-decode). Larger decodes are a choice:
# `max_rows_per_decode`, or a larger `max_staleness`, which "auto" then fills.
DEFAULT_ITEMS_PER_DECODE = 1
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
            "several optimizer steps (steps_per_generation > gradient_accumulation_steps, or num_iterations > 1). "
            "With an integer max_rows_per_decode, the smallest value that lets the generator decode that many rows "
            "while the trainer trains on the previous ones (docs/staleness.md#rows-per-decode)."
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
    max_rows_per_decode: int | str | None = field(
        default="auto",
        metadata={
            "help": "Most rows the generation process decodes in one backend call. It decodes the prompts of several "
            "generation batches at once, as many as the staleness bound admits with the pipeline full (the block it "
            "decodes while the trainer trains on the previous one), then hands them out batch by batch, each tagged "
            "with the weights version that sampled it and sampled from its own seed. 'auto': as many as max_staleness "
            "admits, up to 256 rows (one generation batch with the default bound). An integer (at least one "
            "generation batch's rows on this rank): up to that many; with max_staleness unset, the bound is derived "
            "so that blocks of that size keep the pipeline full, which makes rows staler (docs/staleness.md). Logged "
            "as async/rows_per_decode."
        },
    )
    generation_cuda_graphs: str = field(
        default="auto",
        metadata={
            "help": "Decode with CUDA graphs in the generation process (hf backend): a static KV cache and "
            "torch.compile's reduce-overhead mode, batch sizes and prompt widths padded to a few fixed shapes. 'auto': "
            "on when the generation process runs on a CUDA device, 'on': required (an error on other devices), "
            "'off': transformers' dynamic cache. If compiling fails at run time, the generation process falls back "
            "to eager decoding with a warning (async/cuda_graphs_fallbacks)."
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
    timeline: bool = field(
        default=True,
        metadata={
            "help": "Record where the time goes: every process of the run (each trainer rank and its generation "
            "process) records spans (waiting for a batch, scoring, forward + backward, publishing; gate waits, "
            "prefill, decode, rewards, loading weights) into OUTPUT_DIR/timeline.json, Chrome's trace-event format "
            "(Perfetto, chrome://tracing). The first 200 steps whole, then 5 of every 100; under 1%% of step time. "
            "`python -m trl_async.timeline OUTPUT_DIR` summarizes it (docs/timeline.md)."
        },
    )
    inflight_weight_updates: bool = field(
        default=False,
        metadata={
            "help": "Load newer published weights between decoding steps, as PipelineRL does, instead of only between "
            "generation batches (hf backend). Every completion token records the version that sampled it, and its μ "
            "is that distribution's log-prob, so the importance correction and M2PO stay exact per token. A batch's "
            "staleness is its oldest token's: the generation process prepares (draws, tokenizes) the next batch as "
            "soon as the queue has room and waits for recent enough weights only before the model first runs on it. "
            "The key/value cache of earlier tokens is kept as older weights computed it (docs/staleness.md)."
        },
    )
    fixed_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Research knob for staleness studies (docs/staleness.md): every generation batch is generated with "
            "exactly the weights max_staleness = fixed_staleness versions older than the version at which it is last "
            "trained on (batch n with the weights of version n - k on TRL's default schedule), independently of "
            "timing. The run is an ordinary asynchronous run whose generator weights are held back: the trainer "
            "waits before publishing each version until the generation process has loaded the previous one, and "
            "every batch comes from the generation process. The first batches, before k versions exist, use the "
            "initial weights. Needs weight_sync_steps=1 and a derived queue_capacity. None (default): off.",
        },
    )
    tool_timeout: float | None = field(
        default=60.0,
        metadata={
            "help": "Seconds a single tool call, environment factory call or environment `reset` may take in the "
            "generation process (tools=, environment_factory=; docs/agentic.md). One that has not returned by then "
            "ends the run with an error naming it (a hung call cannot be interrupted: the generation process stops, "
            "and nothing is left running). A tool that raises is TRL's case, not this one: the model gets TRL's error "
            "result and the call counts in tools/failure_frequency. None: no limit."
        },
    )
    tool_call_threads: int = field(
        default=8,
        metadata={
            "help": "Threads on which the generation process runs the tool calls of a batch's first tool round "
            "concurrently (tools=, environment_factory=; docs/agentic.md): TRL's loop calls them one rollout after "
            "another, which with a tool of real latency (a search, a sandbox) leaves the generation process waiting "
            "on each in turn. One rollout's calls keep their order on one thread, and results and errors are the "
            "calls' own; tools shared by rollouts must be thread-safe. Later rounds run as TRL runs them. 1: TRL's "
            "one-after-another order."
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
            "(trl_async/trainers/forward.py), with the log-probs and gradients of TRL's forward: the rows of a group are "
            "packed into one sequence, each completion attending to the shared prompt and to itself; where that "
            "saves under 20%% of the tokens (long completions), the prompts run once as a key/value prefix that the "
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

    def __post_init__(self):
        super().__post_init__()
        ensure_async_fields(self, LOSS_TYPES)


ASYNC_FIELDS = tuple(
    f for f in dataclasses.fields(AsyncGRPOConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
)


def async_field(args, name: str):
    """An async/M2PO field of `args`, or its default when `args` lacks it (a plain `GRPOConfig`, a namespace)."""
    return getattr(args, name, _ASYNC_DEFAULTS[name])


_ASYNC_DEFAULTS = {f.name: f.default for f in ASYNC_FIELDS}


def ensure_async_fields(args: GRPOConfig, loss_types: tuple[str, ...] = LOSS_TYPES) -> GRPOConfig:
    """Give a plain `GRPOConfig` the async defaults (in place), resolve `max_staleness=None`, and validate.

    A value the user set explicitly is validated as given: too small a `max_staleness` for the schedule is an error.
    Only an unset one (`None`, or absent from a plain `GRPOConfig`) is derived from the schedule, and logged.
    """
    for f in ASYNC_FIELDS:
        if not hasattr(args, f.name):
            setattr(args, f.name, f.default)
    args.max_rows_per_decode = _normalised_rows_per_decode(args.max_rows_per_decode)
    if args.max_staleness is None and args.fixed_staleness is not None:
        args.max_staleness = args.fixed_staleness
    if args.max_staleness is None and getattr(args, "gradient_accumulation_steps", None) is not None:
        items = _wanted_items_per_decode(args)
        args.max_staleness = pipelined_max_staleness(items, *_schedule(args))
        logger.info(
            "trl_async: max_staleness=%d (derived: each generation batch is trained on across %d optimizer step(s), "
            "and the generation process decodes %d generation batch(es) per call while the trainer trains on the "
            "previous ones); set it in AsyncGRPOConfig to choose another bound.",
            args.max_staleness,
            usage_span(args) + 1,
            items,
        )
    validate_async_fields(args, loss_types)
    return args


def _normalised_rows_per_decode(value):
    """'auto' or a positive integer (the command line passes integers as strings)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _schedule(args) -> tuple[int, int]:
    """(micro-steps fed by one generation batch, micro-steps per optimizer step): TRL's schedule."""
    return args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps


def rows_per_generation_batch(args) -> int | None:
    """Rows of one generation batch on one rank (TRL's `generation_batch_size` is over every process)."""
    if getattr(args, "generation_batch_size", None) is None:
        return None
    return args.generation_batch_size // max(1, getattr(args, "world_size", 1))


def _wanted_items_per_decode(args) -> int:
    """Generation batches per decode that the derived bound is made for: the user's `max_rows_per_decode` in whole
    batches, or with 'auto' `DEFAULT_ITEMS_PER_DECODE`."""
    rows = rows_per_generation_batch(args)
    cap = args.max_rows_per_decode
    if isinstance(cap, int) and not isinstance(cap, bool) and rows:
        return max(1, cap // rows)
    return DEFAULT_ITEMS_PER_DECODE


def items_per_decode(args, agentic: bool = False) -> int:
    """How many generation batches the generation process decodes in one call: as many as the staleness bound
    admits with the pipeline full (`schedule.items_per_decode_within`), within `max_rows_per_decode`. One with
    `fixed_staleness` (each batch has its own exact weights), in agentic runs (TRL's multi-turn loop runs one batch
    at a time) and for synchronous runs."""
    rows = rows_per_generation_batch(args)
    if not args.async_generation or args.fixed_staleness is not None or agentic or not rows:
        return 1
    cap = args.max_rows_per_decode
    at_most = cap // rows if isinstance(cap, int) else max(1, AUTO_MAX_ROWS_PER_DECODE // rows)
    g, a = _schedule(args)
    capacity = args.queue_capacity or -(-(args.max_staleness + 1) * a // g)
    return items_per_decode_within(args.max_staleness, capacity, g, a, at_most)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_async_fields(args, loss_types: tuple[str, ...] = LOSS_TYPES) -> None:
    """Validate the async and M2PO fields, and their consistency with TRL's batch geometry. `loss_types`: those the
    trainer implements (`LOSS_TYPES` for `AsyncGRPOTrainer`, `config.ppo.PPO_LOSS_TYPES` for `AsyncPPOTrainer`)."""
    _check(
        args.loss_type in loss_types,
        f"loss_type={args.loss_type!r} is unknown. Use one of {list(loss_types)}.",
    )
    fixed = args.fixed_staleness
    _check(
        fixed is None or (isinstance(fixed, int) and not isinstance(fixed, bool) and fixed >= 0),
        f"fixed_staleness must be None (off) or an integer >= 0, got {fixed!r}.",
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
    rows_cap = args.max_rows_per_decode
    _check(
        rows_cap == "auto" or (isinstance(rows_cap, int) and not isinstance(rows_cap, bool) and rows_cap >= 1),
        f"max_rows_per_decode must be 'auto' or an integer >= 1, got {rows_cap!r}.",
    )
    rows = rows_per_generation_batch(args)
    _check(
        not isinstance(rows_cap, int) or rows is None or rows_cap >= rows,
        f"max_rows_per_decode={rows_cap} is below one generation batch ({rows} rows on each process: "
        "generation_batch_size / number of processes), which is decoded whole. Raise it to at least "
        f"{rows}, or leave it 'auto'.",
    )
    _check(
        args.generation_cuda_graphs in CUDA_GRAPH_SETTINGS,
        f"generation_cuda_graphs must be one of {list(CUDA_GRAPH_SETTINGS)}, got {args.generation_cuda_graphs!r}.",
    )
    _check(
        args.generation_cuda_graphs != "on" or args.generation_backend == "hf",
        "generation_cuda_graphs='on' applies to generation_backend='hf' (vLLM captures its own CUDA graphs); set it "
        "to 'auto' or 'off'.",
    )
    _check(
        not (args.async_generation and getattr(args, "use_transformers_continuous_batching", False)),
        "use_transformers_continuous_batching=True is not supported with asynchronous generation: its path records "
        "no behaviour log-probs in the trainer's parametrization, and the generation process already decodes several "
        "generation batches per call (max_rows_per_decode). Unset it, or set async_generation=False to run TRL's "
        "continuous batching in the training process.",
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
    threads = args.tool_call_threads
    _check(
        isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
        f"tool_call_threads must be an integer >= 1 (1: one call after another, as TRL makes them), got {threads!r}.",
    )
    tool_timeout = args.tool_timeout
    _check(
        tool_timeout is None
        or (isinstance(tool_timeout, (int, float)) and not isinstance(tool_timeout, bool) and tool_timeout > 0),
        f"tool_timeout must be None (no limit) or a positive number of seconds, got {tool_timeout!r}.",
    )
    _check(
        isinstance(args.inflight_weight_updates, bool),
        f"inflight_weight_updates must be True or False, got {args.inflight_weight_updates!r}.",
    )
    if args.inflight_weight_updates:
        _check(
            args.generation_backend == "hf",
            "inflight_weight_updates=True is implemented for generation_backend='hf' only; set it to False for vLLM.",
        )
        _check(
            fixed is None,
            "inflight_weight_updates=True loads the newest weights while fixed_staleness holds them back; unset one.",
        )
    if fixed is not None:
        _validate_fixed_staleness(args)
    _validate_m2po_fields(args)
    if args.async_generation and args.max_staleness is not None:
        _validate_schedule(args)


def _validate_fixed_staleness(args) -> None:
    fixed = args.fixed_staleness
    _check(args.async_generation, "fixed_staleness needs async_generation=True (it holds the generator's weights "
           "back); unset it for a synchronous run.")  # fmt: skip
    _check(
        args.max_staleness == fixed,
        f"fixed_staleness={fixed} generates every batch exactly max_staleness versions old, but max_staleness="
        f"{args.max_staleness}. Leave max_staleness unset (it follows fixed_staleness) or set it to {fixed}.",
    )
    _check(
        args.weight_sync_steps == 1,
        f"fixed_staleness needs every version published (weight_sync_steps=1), got weight_sync_steps="
        f"{args.weight_sync_steps}.",
    )
    _check(
        not isinstance(args.max_rows_per_decode, int) or args.max_rows_per_decode == rows_per_generation_batch(args),
        f"fixed_staleness generates every generation batch with its own exact weights, one batch per decode, but "
        f"max_rows_per_decode={args.max_rows_per_decode} asks for several. Leave it 'auto'.",
    )
    _check(
        args.queue_capacity is None,
        f"fixed_staleness needs the derived queue_capacity (room for every batch the bound admits), got "
        f"queue_capacity={args.queue_capacity}. Leave it unset.",
    )


def _validate_m2po_fields(args) -> None:
    _check(
        args.m2po_threshold is not None and args.m2po_threshold > 0,
        f"m2po_threshold must be > 0 (τ_M2, the paper uses 0.04), got {args.m2po_threshold!r}.",
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
            getattr(args, "gradient_accumulation_steps", 1) == 1,
            "m2po_scope='global' selects over the whole optimizer batch and needs gradient_accumulation_steps=1 "
            "(raise per_device_train_batch_size instead), or use m2po_scope='micro_batch'.",
        )


def _validate_schedule(args) -> None:
    """The bound must admit the schedule's own span, and the weights the generator waits for must be published."""
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
