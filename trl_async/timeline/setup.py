"""Making the recorders of a run: the trainer rank's (`trainer_recorder`) and its generation process's
(`generator_recorder`, from the `TimelineSpec` the trainer hands over in `GeneratorSpec`)."""

from __future__ import annotations

import dataclasses

from .names import GENERATOR, SPAWN, TRAINER
from .recorder import DisabledRecorder, Recorder, SamplingPolicy, disabled
from .trace import clear_fragments, fragment_path


@dataclasses.dataclass(frozen=True)
class TimelineSpec:
    """What a generation process needs to record its timeline; picklable (it travels in `GeneratorSpec`).
    `first_step`: the trainer's (the policy counts both processes' steps from it, so they keep the same ones);
    `spawn_ns`: the trainer's `perf_counter_ns()` just before it started the process (the start-up's first mark)."""

    output_dir: str
    policy: SamplingPolicy = dataclasses.field(default_factory=SamplingPolicy)
    first_step: int | None = 0
    spawn_ns: int | None = None
    flush_interval_s: float = 30.0


def trainer_recorder(
    output_dir: str,
    rank: int,
    world_size: int,
    enabled: bool = True,
    policy: SamplingPolicy | None = None,
    cores: int | None = None,
) -> Recorder | DisabledRecorder:
    """A trainer rank's recorder, its run's first step taken from its first `set_step` (a resumed run's); removes
    this rank's fragments of an earlier run in `output_dir` (its trainer's and its generator's). `enabled=False`: the
    disabled recorder, and nothing is touched."""
    if not enabled:
        return disabled()
    clear_fragments(output_dir, rank)
    return Recorder(
        TRAINER,
        rank,
        world_size=world_size,
        fragment_path=fragment_path(output_dir, TRAINER, rank),
        policy=policy,
        first_step=None,
        cores=cores,
    )


def generator_recorder(
    spec: TimelineSpec | None, rank: int, world_size: int, cores: int | None = None
) -> Recorder | DisabledRecorder:
    """A generation process's recorder (None: the disabled one), with the spawn mark the trainer measured."""
    if spec is None:
        return disabled()
    recorder = Recorder(
        GENERATOR,
        rank,
        world_size=world_size,
        fragment_path=fragment_path(spec.output_dir, GENERATOR, rank),
        policy=spec.policy,
        first_step=spec.first_step,
        flush_interval_s=spec.flush_interval_s,
        cores=cores,
    )
    if spec.spawn_ns is not None:
        recorder.instant(SPAWN, at_ns=spec.spawn_ns)
    return recorder
