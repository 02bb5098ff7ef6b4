"""TRL's training schedule as policy versions, written once: which version trains on which generation batch.

TRL generates at micro-steps 0, g, 2g, ... (g = steps_per_generation × num_iterations, TRL's `generate_every`) and
takes an optimizer step (a new policy version) every a = gradient_accumulation_steps micro-steps. Generation batch n
feeds micro-steps [n·g, n·g + g − 1], so, counted from the version the schedule started at, it first enters a loss at
version ⌊n·g / a⌋ and last at ⌊(n·g + g − 1) / a⌋.

The staleness bound is checked at the last use (a batch trained on across several optimizer steps is oldest there);
the queue's gate predicts it with `last_use_version`, the trainer computes it from where it stands with
`versions_until_last_use`, and the config derives the default bound from `usage_span`.
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


def default_max_staleness(args) -> int:
    """The smallest bound that lets batch n+1 be generated while batch n trains: its usage span plus one."""
    return usage_span(args) + 1
