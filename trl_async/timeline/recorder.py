"""The recording side: one `Recorder` per process, spans buffered in memory as tuples, flushed to a fragment file.

**Hot path.** `start = rec.begin()` is `time.perf_counter_ns` itself (a C call, no Python frame); `rec.end(name,
start)` appends one tuple `(name, category, start_ns, end_ns)` to a list. No dict, no JSON, no lock: a list append is
atomic under the GIL. Everything else (JSON, files, merging) happens in `flush`, at log steps, batch boundaries and
exit. `benchmarks/bench_timeline_overhead.py` measures the cost per span.

**Clock.** `time.perf_counter_ns` is `clock_gettime(CLOCK_MONOTONIC)` on Linux, one clock for every process of a
host (forked, spawned or fork-server children included), so spans of the trainer and of its generation process line
up without any exchange. Each fragment's header also holds one (monotonic, Unix) pair read together, which is how
hosts with different monotonic clocks are placed on one axis (`trace.merge_fragments`).

**Bound (`SamplingPolicy`).** `set_step(step)` opens a step: the first `full_steps` steps are kept whole, then
`burst` consecutive steps out of every `every`. Spans are kept when they overlap a kept step; the kept steps form the
`step` track of the trace, which is what the analysis treats as the recorded wall time. A hard cap (`max_events`)
stops recording if a process records far more spans per step than expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time

from .names import BUSY, STARTUP

FRAGMENT_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class SamplingPolicy:
    """Which steps are recorded: steps `0 .. full_steps - 1` (counted from the run's first step) in full, then
    `burst` consecutive steps out of every `every` (the first `burst` of each block of `every`). `max_events` caps the
    spans of one process whatever happens. Defaults: a 10,000-step run keeps 200 + 98 x 5 = 690 steps."""

    full_steps: int = 200
    every: int = 100
    burst: int = 5
    max_events: int = 200_000

    def __post_init__(self):
        if self.full_steps < 0 or self.every < 1 or not 0 <= self.burst <= self.every or self.max_events < 0:
            raise ValueError(f"invalid SamplingPolicy {self}: needs full_steps >= 0, 0 <= burst <= every, every >= 1")

    def keeps(self, steps_from_start: int) -> bool:
        """Whether the step `steps_from_start` steps after the run's first step is recorded (before it: yes)."""
        if steps_from_start < self.full_steps:
            return True
        return (steps_from_start - self.full_steps) % self.every < self.burst


class _Span:
    """`with rec.span(name):` — records on exit, exceptions included (the span shows where the process was)."""

    __slots__ = ("_recorder", "_name", "_category", "_start")

    def __init__(self, recorder, name: str, category: str):
        self._recorder, self._name, self._category = recorder, name, category

    def __enter__(self):
        self._start = self._recorder.begin()
        return self

    def __exit__(self, *exc):
        self._recorder.end(self._name, self._start, self._category)
        return False


def _peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (getrusage: kilobytes on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _boot_id() -> str | None:
    """The kernel's id of this boot: processes with the same one share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Recorder:
    """Spans, instants and kept steps of one process (`role` "trainer" or "generator", data-parallel `rank`).

    `fragment_path`: the JSON-lines file `flush` appends to (None: keep everything in memory, `chunks()`); an old
    file at that path is removed now, so a run never merges a previous run's fragment. `first_step`: the step the
    run starts at (a resumed run's), from which `policy` counts; None: the first `set_step`'s. `cores`: the cores the process may use (its thread
    budget; default its CPU affinity), the denominator of CPU fractions. `clock`, `cpu_clock`, `unix_clock`: tests.
    """

    enabled = True

    def __init__(
        self,
        role: str,
        rank: int = 0,
        *,
        world_size: int = 1,
        fragment_path: str | None = None,
        policy: SamplingPolicy | None = None,
        first_step: int | None = 0,
        flush_interval_s: float = 30.0,
        cores: int | None = None,
        clock=time.perf_counter_ns,
        cpu_clock=time.process_time_ns,
        unix_clock=time.time_ns,
    ):
        self.role, self.rank, self.world_size = role, rank, world_size
        self.policy = policy or SamplingPolicy()
        self.first_step = first_step
        self.fragment_path = fragment_path
        self.begin = clock  # `start = rec.begin()`: the clock itself, the cheapest call there is
        self._now, self._cpu = clock, cpu_clock
        self._events: list[tuple] = []  # (name, category, start_ns, end_ns[, cpu_ns])
        self._instants: list[tuple] = []  # (name, ns)
        self._steps: list[tuple] = []  # (step or None, start_ns, end_ns, cpu_ns): the kept steps
        self._flushed = 0  # spans flushed so far (with `_events`: what `max_events` caps)
        self._memory: list[dict] = []  # the chunks an in-memory recorder flushed
        self.truncated = False  # `max_events` reached: nothing more is kept
        self.closed = False
        now = clock()
        self.header = {
            "format": FRAGMENT_FORMAT,
            "role": role,
            "rank": rank,
            "world_size": world_size,
            "os_pid": os.getpid(),
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "cores": cores or _cores(),
            "clock": {"monotonic_ns": now, "unix_ns": unix_clock()},
            "policy": dataclasses.asdict(self.policy),
            "first_step": first_step,
        }
        # The open step: `None` until the first `set_step` (start-up), always kept.
        self._step, self._keep, self._step_start, self._step_cpu = None, True, now, cpu_clock()
        self._last_end = 0  # see `last_end`
        self._closed_ns = 0  # when the last kept step closed: spans that began before it overlap a kept step
        self._flush_interval_ns = int(flush_interval_s * 1e9)
        self._next_flush = now + self._flush_interval_ns
        self._header_written = False
        if fragment_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(fragment_path)

    # ------------------------------------------------------------------------------------------------ hot path
    def end(self, name: str, start: int, category: str = BUSY, args: dict | None = None) -> None:
        """Close a span opened by `start = rec.begin()`. Kept if it overlaps a kept step. `args`: what the trace shows
        with the span (a decode's rows), JSON values."""
        now = self._last_end = self._now()
        if self._keep or start < self._closed_ns:
            self._events.append(
                (name, category, start, now) if args is None else (name, category, start, now, None, args)
            )

    def last_end(self) -> int:
        """When the last span closed by `end` ended (0 before any): where a span that follows it begins, for a caller
        that did not see it close (the optimizer step after the last micro-batch's forward + backward)."""
        return self._last_end

    def span(self, name: str, category: str = BUSY) -> _Span:
        """The same as a context manager (about twice the cost of `begin`/`end`)."""
        return _Span(self, name, category)

    # ------------------------------------------------------------------------------------------------ rarer calls
    def add(self, name: str, start: int, end: int, category: str = BUSY, cpu_ns: int | None = None) -> None:
        """A span whose ends were measured elsewhere (e.g. a child's spawn time taken by the parent)."""
        if self._keep or start < self._closed_ns:
            self._events.append(
                (name, category, start, end) if cpu_ns is None else (name, category, start, end, cpu_ns)
            )

    def begin_cpu(self) -> tuple[int, int]:
        """`begin` plus this process's CPU time (all threads): for spans whose core usage is wanted (a synchronous
        run's generation and training, `analysis.sync_limit`). One more clock read at each end."""
        return self._now(), self._cpu()

    def end_cpu(self, name: str, begun: tuple[int, int], category: str = BUSY) -> None:
        start, cpu = begun
        if self._keep or start < self._closed_ns:
            self._events.append((name, category, start, self._now(), self._cpu() - cpu))

    def instant(self, name: str, at_ns: int | None = None) -> None:
        """A moment (start-up marks), always kept; `at_ns` for one measured elsewhere (same clock)."""
        if len(self._instants) < self.policy.max_events:
            self._instants.append((name, self._now() if at_ns is None else at_ns))

    def set_step(self, step: int) -> None:
        """Enter `step` (the trainer's global step; a generation process's loaded weights version). Closes the open
        step (kept: onto the step track, with its CPU time) and decides whether the new one is kept. Same step: no-op."""
        if step == self._step:
            return
        now, cpu = self._now(), self._cpu()
        if self._keep:
            self._steps.append((self._step, self._step_start, now, cpu - self._step_cpu))
            self._closed_ns = now
        self._step, self._step_start, self._step_cpu = step, now, cpu
        if self.first_step is None:
            self.first_step = self.header["first_step"] = step
        if self._flushed + len(self._events) >= self.policy.max_events:
            self.truncated = True
        self._keep = not (self.truncated or self.closed) and self.policy.keeps(step - self.first_step)

    # ------------------------------------------------------------------------------------------------ output
    def _take_chunk(self, final: bool) -> dict:
        if final and self._keep:  # the open step ends here
            now = self._now()
            self._steps.append((self._step, self._step_start, now, self._cpu() - self._step_cpu))
            self._closed_ns, self._keep = now, False
        chunk = {"spans": self._events, "instants": self._instants, "steps": self._steps, "truncated": self.truncated,
                 "peak_rss_bytes": _peak_rss_bytes()}  # fmt: skip
        self._flushed += len(self._events)
        self._events, self._instants, self._steps = [], [], []
        return chunk

    def flush(self) -> None:
        """Append what was recorded since the last flush to the fragment file, as one JSON line written with one
        `write` (a process killed mid-write leaves one torn last line, which readers skip)."""
        self._write(self._take_chunk(final=False))

    def _write(self, chunk: dict) -> None:
        self._next_flush = self._now() + self._flush_interval_ns
        if self.fragment_path is None:
            self._memory.append(chunk)
            return
        lines = [] if self._header_written else [json.dumps({"header": self.header}, separators=(",", ":"))]
        if chunk["spans"] or chunk["instants"] or chunk["steps"] or not self._header_written:
            lines.append(json.dumps(chunk, separators=(",", ":")))
        if not lines:
            return
        os.makedirs(os.path.dirname(self.fragment_path) or ".", exist_ok=True)
        with open(self.fragment_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        self._header_written = True

    def maybe_flush(self) -> None:
        """`flush` if `flush_interval_s` passed since the last one (a generation process calls it per batch)."""
        if self._now() >= self._next_flush:
            self.flush()

    def close(self) -> None:
        """The final flush (idempotent: a closed recorder records nothing more)."""
        if not self.closed:
            self.closed = True
            self._write(self._take_chunk(final=True))  # the open step ends now

    def chunks(self) -> list[dict]:
        """What an in-memory recorder (`fragment_path=None`) flushed, plus what it holds now."""
        return [*self._memory, self._take_chunk(final=False)]


class DisabledRecorder:
    """`timeline=False`: the same interface, recording nothing. `begin` is `int` (returns 0, a C call)."""

    enabled = False
    begin = staticmethod(int)
    truncated = False
    fragment_path = None

    def end(self, name, start, category=BUSY, args=None):
        pass

    def last_end(self):
        return 0

    def span(self, name, category=BUSY):
        return _NULL_SPAN

    def add(self, name, start, end, category=BUSY, cpu_ns=None):
        pass

    def begin_cpu(self):
        return (0, 0)

    def end_cpu(self, name, begun, category=BUSY):
        pass

    def instant(self, name, at_ns=None):
        pass

    def set_step(self, step):
        pass

    def flush(self):
        pass

    def maybe_flush(self):
        pass

    def close(self):
        pass

    def chunks(self):
        return []


_NULL_SPAN = contextlib.nullcontext()
_DISABLED = DisabledRecorder()
_current: Recorder | DisabledRecorder = _DISABLED


def disabled() -> DisabledRecorder:
    """The recorder that records nothing (one shared instance)."""
    return _DISABLED


def current() -> Recorder | DisabledRecorder:
    """This process's recorder (`set_current`), for code far from where it was made (the hf backend's decoding loop,
    the weight store); the disabled one until set."""
    return _current


def set_current(recorder: Recorder | DisabledRecorder | None) -> None:
    global _current
    _current = recorder if recorder is not None else _DISABLED


__all__ = [
    "DisabledRecorder",
    "Recorder",
    "STARTUP",
    "SamplingPolicy",
    "current",
    "disabled",
    "set_current",
]
