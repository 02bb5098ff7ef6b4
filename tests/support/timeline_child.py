"""The child of `tests/test_timeline.py`'s real-process test: a stand-in generation process that records what the
real one will (start-up marks, a batch's spans) into its own fragment, as the integration plan has it."""

from __future__ import annotations

import pickle
import time

from trl_async.timeline import generator_recorder, names


def generator_main(spec_blob: bytes, rank: int, world_size: int) -> None:
    recorder = generator_recorder(pickle.loads(spec_blob), rank, world_size)  # marks the trainer's spawn time
    recorder.instant(names.IMPORTS_DONE)
    recorder.instant(names.READY)
    for version in (3, 4):
        recorder.set_step(version)
        start = recorder.begin()
        time.sleep(0.01)
        recorder.end(names.DECODE, start)
        with recorder.span(names.WRITE_BATCH):
            time.sleep(0.002)
        if version == 3:
            recorder.instant(names.FIRST_BATCH_QUEUED)
        recorder.maybe_flush()
    recorder.close()
