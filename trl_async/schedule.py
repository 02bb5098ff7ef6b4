"""TRL's training schedule as policy versions, written once: which version trains on which generation batch.

TRL generates at micro-steps 0, g, 2g, ... (g = steps_per_generation × num_iterations, TRL's `generate_every`) and
takes an optimizer step (a new policy version) every a = gradient_accumulation_steps micro-steps. Generation batch n
feeds micro-steps [n·g, n·g + g − 1], so, counted from the version the schedule started at, it first enters a loss at
version ⌊n·g / a⌋ and last at ⌊(n·g + g − 1) / a⌋.

The staleness bound is checked at the last use (a batch trained on across several optimizer steps is oldest there);
the queue's gate predicts it with `last_use_version`, the trainer computes it from where it stands with
`versions_until_last_use`, and the config derives the default bound from `pipelined_max_staleness` (with one batch
per decode, `usage_span` + 1).
"""

from __future__ import annotations


def micro_steps_per_generation(args) -> int:
    """How many training micro-steps one generation batch feeds (TRL's `generate_every`)."""
    return args.steps_per_generation * args.num_iterations


def versions_until_last_use(micro_step: int, micro_steps_per_item: int, micro_steps_per_version: int) -> int:
    """Optimizer steps between micro-step `micro_step`, where a generation batch starts to be used, and its last use."""
    g, a = micro_steps_per_item, micro_steps_per_version
    return (micro_step + g - 1) // a - micro_step // a


def last_use_version(
    index: int, micro_steps_per_item: int = 1, micro_steps_per_version: int = 1, base: int = 0
) -> int:
    """Version at which batch `index` is last used, when the consumer takes one batch every `micro_steps_per_item`
    micro-steps and advances one version every `micro_steps_per_version` micro-steps, starting at version `base`."""
    first_micro_step = index * micro_steps_per_item
    return (
        base
        + first_micro_step // micro_steps_per_version
        + versions_until_last_use(first_micro_step, micro_steps_per_item, micro_steps_per_version)
    )


def first_and_last_use(index: int, args, base_version: int = 0) -> tuple[int, int]:
    """Policy versions at which generation batch `index` of TRL's schedule under `args` first and last enters a loss."""
    g, a = micro_steps_per_generation(args), args.gradient_accumulation_steps
    return base_version + (index * g) // a, last_use_version(index, g, a, base_version)


def usage_span(args) -> int:
    """Most optimizer steps between the first and last use of one generation batch (the schedule repeats every a)."""
    return max(
        last - first for first, last in (first_and_last_use(n, args) for n in range(args.gradient_accumulation_steps))
    )


def first_use_version(
    index: int, micro_steps_per_item: int = 1, micro_steps_per_version: int = 1, base: int = 0
) -> int:
    """Version at which batch `index` first enters a loss: the trainer's version when it takes the batch."""
    return base + (index * micro_steps_per_item) // micro_steps_per_version


def pipelined_max_staleness(items_per_decode: int, micro_steps_per_item: int, micro_steps_per_version: int) -> int:
    """The smallest bound under which the generator can decode `k = items_per_decode` batches in one call while the
    trainer trains on the previous k, so that neither waits for the other when their speeds match.

    The block [r, r + k) may start decoding when the trainer starts its predecessor's first batch that it still
    needs (r − k + 1 is taken at version f(r − k + 1), after training r − k); its last batch is used at
    l(r + k − 1). The bound must cover that distance plus the one version of overlap a single batch already gets:

        S_k = max_r  l(r + k − 1) − f(r − k + 1) + 1     (f, l: `first_use_version`, `last_use_version`)

    k = 1 gives `usage_span + 1`, the engine's default bound (batch n + 1 generated while batch n trains). On TRL's
    default schedule (one batch per optimizer step) S_k = 2k − 1: the block's batches are k to 2k − 1 versions old
    when used (docs/staleness.md)."""
    k, g, a = items_per_decode, micro_steps_per_item, micro_steps_per_version
    if k < 1:
        raise ValueError(f"items_per_decode must be >= 1, got {k}")
    # The schedule repeats every `a` batches (a batch's micro-steps advance by g, versions by g / a); scanning one
    # period after the block's predecessor exists covers every r.
    return max(
        last_use_version(r + k - 1, g, a) - first_use_version(r - k + 1, g, a) + 1 for r in range(k - 1, k - 1 + a)
    )


def items_per_decode_within(max_staleness: int, capacity: int, micro_steps_per_item: int, micro_steps_per_version: int,
                            at_most: int) -> int:  # fmt: skip
    """The most batches (≤ `at_most`, ≥ 1) one decode may hold so that the pipeline stays full within `max_staleness`
    (`pipelined_max_staleness`) and the queue has room for the block beside the one the trainer is on (2k batches
    outstanding at most)."""
    k = 1
    while (
        k < at_most
        and pipelined_max_staleness(k + 1, micro_steps_per_item, micro_steps_per_version) <= max_staleness
        and 2 * (k + 1) <= capacity
    ):
        k += 1
    return k


def items_first_used_before(
    version: int, micro_steps_per_item: int, micro_steps_per_version: int, base: int = 0
) -> int:
    """How many generation batches, counted from the schedule's start at `base`, enter a loss before `version` is
    reached: those whose first micro-step comes before version's first, ⌈(version − base)·a / g⌉."""
    return max(0, -(-(version - base) * micro_steps_per_version // micro_steps_per_item))
