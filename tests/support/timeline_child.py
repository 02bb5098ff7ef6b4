"""The child of `tests/test_timeline.py`'s real-process test: a stand-in generation process that records what the
real one will (start-up marks, a batch's spans) into its own fragment, as the integration plan has it."""

from __future__ import annotations

import time

from trl_async.timeline import Recorder, SamplingPolicy, fragment_path, names


def generator_main(output_dir: str, rank: int, spawn_ns: int, first_step: int) -> None:
    recorder = Recorder(
        names.GENERATOR,
        rank,
        fragment_path=fragment_path(output_dir, names.GENERATOR, rank),
        policy=SamplingPolicy(full_steps=10),
        first_step=first_step,
    )
    recorder.instant(names.SPAWN, at_ns=spawn_ns)  # measured by the parent, on the same clock
    recorder.instant(names.IMPORTS_DONE)
    recorder.add(names.STARTUP_SPAN, spawn_ns, recorder.begin(), names.STARTUP)
    recorder.instant(names.READY)
    for version in (first_step, first_step + 1):
        recorder.set_step(version)
        start = recorder.begin()
        time.sleep(0.01)
        recorder.end(names.DECODE, start)
        with recorder.span(names.WRITE_BATCH):
            time.sleep(0.002)
        if version == first_step:
            recorder.instant(names.FIRST_BATCH_QUEUED)
        recorder.maybe_flush()
    recorder.close()
