"""Where the time goes: a timeline of every run (docs/timeline.md).

Each process (every trainer rank, every generation process) records spans into a `Recorder`: `start = rec.begin()`
then `rec.end(name, start)`, or `with rec.span(name):`; a cheap monotonic clock and a tuple appended to a list. A
recorder appends what it recorded to its own fragment file (`OUTPUT_DIR/_timeline-fragments/`, `flush`), and the
trainer that saves merges the fragments into `OUTPUT_DIR/timeline.json`, Chrome's trace-event format
(`write_timeline`; `TimelineWriter` says when, keeping merges under 0.1% of the run): Perfetto and chrome://tracing open it. No collective: files only. `SamplingPolicy` bounds the
size (the first 200 steps whole, then 5 steps in every 100); `disabled()` records nothing.

`trainer_recorder` / `generator_recorder` (with the `TimelineSpec` a trainer hands its generation process) make a
run's recorders.

Reading a run: `python -m trl_async.timeline OUTPUT_DIR`, or `summarize(path)`, `draw_gantt(path, png, steps)`,
`ideal_overlap_ratio(path)` / `sync_limit(path)` for a synchronous run.
"""

from . import names
from .analysis import ideal_overlap_ratio, summarize, sync_limit
from .recorder import DisabledRecorder, Recorder, SamplingPolicy, current, disabled, set_current
from .setup import TimelineSpec, generator_recorder, trainer_recorder
from .trace import (
    FRAGMENT_DIR,
    TIMELINE_FILE,
    TimelineWriter,
    clear_fragments,
    fragment_path,
    load_trace,
    merge_fragments,
    read_fragments,
    write_timeline,
)


def draw_gantt(path_or_trace, png: str, steps=None, rank: int = 0):
    """`gantt.draw_gantt`: the Gantt chart of steps A..B ("A:B", (A, B), or None: 10 middle steps) into `png`.
    Imported on call: matplotlib is needed only to draw."""
    from .gantt import draw_gantt as draw

    return draw(path_or_trace, png, steps, rank)


__all__ = [
    "FRAGMENT_DIR",
    "TIMELINE_FILE",
    "DisabledRecorder",
    "Recorder",
    "SamplingPolicy",
    "TimelineSpec",
    "TimelineWriter",
    "clear_fragments",
    "current",
    "disabled",
    "draw_gantt",
    "fragment_path",
    "generator_recorder",
    "ideal_overlap_ratio",
    "load_trace",
    "merge_fragments",
    "names",
    "read_fragments",
    "set_current",
    "summarize",
    "sync_limit",
    "trainer_recorder",
    "write_timeline",
]
