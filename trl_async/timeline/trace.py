"""Fragments in, one Chrome trace out: `OUTPUT_DIR/_timeline-fragments/*.jsonl` -> `OUTPUT_DIR/timeline.json`.

**Fragments.** Each process appends to its own file, `_timeline-fragments/{role}-rank{rank}.jsonl` (`Recorder.flush`):
a first line `{"header": {...}}` (role, rank, world size, OS pid, host, boot id, cores, sampling policy, one
(monotonic, Unix) clock pair), then one line per flush: `{"spans": [[name, category, start_ns, end_ns(, cpu_ns(, args))]],
"instants": [[name, ns]], "steps": [[step, start_ns, end_ns, cpu_ns]], "truncated": bool}`, times on the process's
`perf_counter_ns` clock. No process ever writes another's file, so nothing is locked and nothing is collective.

**Merging.** Any process may merge whatever fragments it sees (the trainer that saves, at log steps and at the end;
`python -m trl_async.timeline` for a run that died before). Processes on one host (same boot id) share
CLOCK_MONOTONIC: their spans are placed exactly. Each other host is placed through its own trainer's clock pair
(Unix time read beside the monotonic one): exact within the host, as good as the hosts' wall clocks agree (NTP,
typically a millisecond) across hosts. Fragments of ranks beyond rank 0's world size (a previous run's) are ignored.

**The trace** (Chrome's trace-event format, JSON object form; Perfetto and chrome://tracing open it):
`{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`. Each process is one `pid` (100 x (rank + 1)
+ role index: 100 trainer rank 0, 101 its generator, 200 trainer rank 1, ...), named by `M` events (`process_name`
"trainer rank 0", `process_sort_index`, `thread_name`). Thread 1 holds its spans (`ph: "X"`, `ts`/`dur` in
microseconds from the earliest event of the run, `cat` busy/wait/startup, `args.cpu_ms` where measured), nested as
viewers require, and start-up instants (`ph: "i"`); thread 2 the kept steps (`ph: "X"`, `cat: "step"`, named
"step N", `args.step`, `args.cpu_ms`); thread 3 any span that overlaps another without nesting in it.
`otherData.trl_async_timeline` describes the processes and the clock for the analysis.
"""

from __future__ import annotations

import glob
import json
import os
import time

from .names import ROLES, STEP, TRAINER

# The leading underscore: a folder of the run's internals, which `Trainer.push_to_hub` leaves out of the upload.
FRAGMENT_DIR = "_timeline-fragments"
TIMELINE_FILE = "timeline.json"
SPAN_TID, STEP_TID, OVERLAP_TID = 1, 2, 3
TRACE_FORMAT = 1


def fragment_path(output_dir: str, role: str, rank: int) -> str:
    return os.path.join(output_dir, FRAGMENT_DIR, f"{role}-rank{rank}.jsonl")


def clear_fragments(output_dir: str, rank: int) -> None:
    """Remove every fragment of `rank` (its trainer's and its generator's): a rank calls it when its run starts."""
    for path in glob.glob(os.path.join(output_dir, FRAGMENT_DIR, f"*-rank{rank}.jsonl")):
        os.remove(path)


def read_fragment(path: str) -> dict | None:
    """`{"header", "spans", "instants", "steps", "truncated"}`, or None without a header. A torn last line (the
    process was killed while writing it) is skipped."""
    header, spans, instants, steps, truncated, peak_rss = None, [], [], [], False, None
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "header" in record:
                header = record["header"]
                continue
            spans += record.get("spans", [])
            instants += record.get("instants", [])
            steps += record.get("steps", [])
            truncated = truncated or bool(record.get("truncated"))
            if record.get("peak_rss_bytes") is not None:
                peak_rss = max(peak_rss or 0, record["peak_rss_bytes"])
    if header is None:
        return None
    return {"header": header, "spans": spans, "instants": instants, "steps": steps, "truncated": truncated,
            "peak_rss_bytes": peak_rss}  # fmt: skip


def read_fragments(output_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(output_dir, FRAGMENT_DIR, "*.jsonl")))
    return [f for f in (read_fragment(p) for p in paths) if f is not None]


def _role_index(role: str) -> int:
    return ROLES.index(role) if role in ROLES else len(ROLES)


def process_id(role: str, rank: int) -> int:
    return 100 * (rank + 1) + _role_index(role)


def _host_key(header: dict) -> str:
    return header.get("boot_id") or header.get("host") or "?"


def _host_offsets(headers: list[dict]) -> dict[str, int]:
    """Per host: what turns its monotonic ns into Unix ns, read from its lowest-rank trainer (else any process)."""
    anchors: dict[str, dict] = {}
    for header in sorted(headers, key=lambda h: (h["role"] != TRAINER, h["rank"])):
        anchors.setdefault(_host_key(header), header)
    return {key: h["clock"]["unix_ns"] - h["clock"]["monotonic_ns"] for key, h in anchors.items()}


def _ts_dur(us, start: int, end: int) -> tuple[float, float]:
    """`ts` and `dur` from both ends rounded alike: a span nested in another still ends within it once rounded."""
    ts, end_us = us(start), us(max(end, start))
    return ts, round(end_us - ts, 1)


def _nesting_tracks(spans: list) -> list[int]:
    """The thread of each span (sorted by start, longest first): `SPAN_TID`, where spans nest, as trace viewers
    require of one thread's slices; `OVERLAP_TID` for a span that starts inside another and ends after it (two
    threads' spans, or a span measured elsewhere), which a viewer would otherwise drop."""
    tracks, open_ends = [], []
    for _, _, start, end, *_ in spans:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        if open_ends and end > open_ends[-1]:
            tracks.append(OVERLAP_TID)
            continue
        tracks.append(SPAN_TID)
        open_ends.append(end)
    return tracks


def merge_fragments(fragments: list[dict]) -> dict:
    """One Chrome trace of `fragments` (see the module docstring)."""
    reference = next((f for f in fragments if f["header"]["role"] == TRAINER and f["header"]["rank"] == 0), None)
    if reference is not None:
        world_size = reference["header"].get("world_size", 1)
        fragments = [f for f in fragments if f["header"]["rank"] < world_size]
    fragments = sorted(fragments, key=lambda f: (f["header"]["rank"], _role_index(f["header"]["role"])))
    offsets = _host_offsets([f["header"] for f in fragments])
    shift = [offsets[_host_key(f["header"])] for f in fragments]
    times = [
        t + s
        for f, s in zip(fragments, shift, strict=True)
        for t in [*(e[2] for e in f["spans"]), *(i[1] for i in f["instants"]), *(st[1] for st in f["steps"])]
    ]
    origin = min(times) if times else 0

    def us(ns: int) -> float:
        return round(ns / 1000.0, 1)

    events, processes = [], []
    for index, (fragment, host_shift) in enumerate(zip(fragments, shift, strict=True)):
        header = fragment["header"]
        role, rank = header["role"], header["rank"]
        pid, base = process_id(role, rank), host_shift - origin
        label = f"{role} rank {rank}"
        processes.append({
            "pid": pid, "role": role, "rank": rank, "label": label, "os_pid": header.get("os_pid"),
            "host": header.get("host"), "cores": header.get("cores"), "truncated": fragment["truncated"],
            "peak_rss_bytes": fragment.get("peak_rss_bytes"),
            "policy": header.get("policy"), "first_step": header.get("first_step", 0),
        })  # fmt: skip
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": index}},
            {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
             "args": {"labels": f"pid {header.get('os_pid')} on {header.get('host')}"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": SPAN_TID, "args": {"name": "spans"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": STEP_TID, "args": {"name": "recorded steps"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": OVERLAP_TID, "args": {"name": "overlapping spans"}},
        ]  # fmt: skip
        spans = sorted(fragment["spans"], key=lambda sp: (sp[2], -sp[3]))
        for span, tid in zip(spans, _nesting_tracks(spans), strict=True):
            event = {"ph": "X", "name": span[0], "cat": span[1], "pid": pid, "tid": tid}
            event["ts"], event["dur"] = _ts_dur(us, span[2] + base, span[3] + base)
            if len(span) > 4 and span[4] is not None:
                event["args"] = {"cpu_ms": round(span[4] / 1e6, 3)}
            if len(span) > 5:  # what the span carries besides (a decode's rows: `Recorder.end(args=...)`)
                event.setdefault("args", {}).update(span[5])
            events.append(event)
        for name, at in fragment["instants"]:
            events.append({"ph": "i", "s": "p", "name": name, "cat": "startup", "pid": pid, "tid": SPAN_TID,
                           "ts": us(at + base)})  # fmt: skip
        for step, start, end, cpu in fragment["steps"]:
            ts, dur = _ts_dur(us, start + base, end + base)
            events.append({
                "ph": "X", "name": "start-up" if step is None else f"step {step}", "cat": STEP, "pid": pid,
                "tid": STEP_TID, "ts": ts, "dur": dur, "args": {"step": step, "cpu_ms": round(cpu / 1e6, 3)},
            })  # fmt: skip
    # Metadata first, then by time, a span before those it holds (same start: longest first), as viewers expect.
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0), -e.get("dur", 0.0)))
    other = {
        "format": TRACE_FORMAT,
        "clock": "perf_counter_ns (CLOCK_MONOTONIC on Linux); hosts aligned by their own trainer's Unix clock",
        "origin_unix_ns": origin,
        "hosts": len(set(offsets)),
        "processes": processes,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"trl_async_timeline": other}}


def write_json_atomically(data: dict, path: str) -> None:
    """Write to a temporary name beside `path`, then `os.replace`: a reader sees the old file or the new one."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(json.dumps(data, separators=(",", ":")))  # dumps: the C encoder (json.dump streams in Python)
    os.replace(temporary, path)


def write_timeline(output_dir: str, path: str | None = None) -> str | None:
    """Merge the fragments under `output_dir` into `path` (default `output_dir/timeline.json`); None if none."""
    fragments = read_fragments(output_dir)
    if not fragments:
        return None
    path = path or os.path.join(output_dir, TIMELINE_FILE)
    write_json_atomically(merge_fragments(fragments), path)
    return path


class TimelineWriter:
    """When the trainer that saves merges the fragments into timeline.json. `maybe_write()` (at log steps) merges once
    `min_interval_s` passed since the last merge and `1 / max_share` times the last merge's duration: merging then
    takes at most `max_share` of the run's time (0.1% by default) however large the trace grows (a bounded
    10,000-step trace merges in ~0.3 s: every ~5 minutes at the end of such a run). `write()` merges now (the end
    of training). `merge(output_dir)` and `clock` are for tests."""

    def __init__(self, output_dir: str, min_interval_s: float = 60.0, max_share: float = 0.001, merge=None,
                 clock=time.perf_counter):  # fmt: skip
        self.output_dir, self.min_interval_s, self.max_share = output_dir, min_interval_s, max_share
        self._merge, self._clock = merge or write_timeline, clock
        self._last_end, self._last_duration = clock(), 0.0

    def maybe_write(self) -> str | None:
        waited = self._clock() - self._last_end
        if waited < max(self.min_interval_s, self._last_duration / self.max_share):
            return None
        return self.write()

    def write(self) -> str | None:
        start = self._clock()
        path = self._merge(self.output_dir)
        self._last_end = self._clock()
        self._last_duration = self._last_end - start
        return path


def resolve(path: str) -> str:
    """A run's folder or a trace file -> the trace file; a folder with fragments but no (or an older) timeline.json
    gets one merged first (a run that died before writing it)."""
    if not os.path.isdir(path):
        return path
    timeline = os.path.join(path, TIMELINE_FILE)
    fragments = glob.glob(os.path.join(path, FRAGMENT_DIR, "*.jsonl"))
    newest = max((os.path.getmtime(p) for p in fragments), default=None)
    if newest is not None and (not os.path.exists(timeline) or os.path.getmtime(timeline) < newest):
        write_timeline(path)
    if not os.path.exists(timeline):
        raise FileNotFoundError(f"{path} has neither {TIMELINE_FILE} nor {FRAGMENT_DIR}/")
    return timeline


def load_trace(path_or_trace) -> dict:
    """A trace dict from a dict, a trace file or a run's folder (`resolve`)."""
    if isinstance(path_or_trace, dict):
        return path_or_trace
    with open(resolve(os.fspath(path_or_trace))) as f:
        return json.load(f)
