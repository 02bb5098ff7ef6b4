"""The run timeline (`trl_async.timeline`): recording, the sampling bound, fragments merged into one Chrome trace
(a real child process included), the analysis against figures computed by hand, and the CLI.

Synthetic recordings run on a hand-driven clock, so every expected figure below is worked out in the comments from
the spans the test itself lays down."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import time

import pytest

from trl_async import timeline
from trl_async.timeline import (
    FRAGMENT_DIR,
    Recorder,
    SamplingPolicy,
    TimelineSpec,
    TimelineWriter,
    current,
    disabled,
    draw_gantt,
    fragment_path,
    ideal_overlap_ratio,
    names,
    summarize,
    sync_limit,
    trainer_recorder,
    write_timeline,
)
from trl_async.timeline.gantt import step_window

S = 1_000_000_000  # ns per second


class HandClock:
    """A clock the test sets: `clock.at(seconds)`; also usable as the CPU clock (`clock.add(seconds)`)."""

    def __init__(self, seconds: float = 0.0):
        self.ns = round(seconds * S)

    def __call__(self) -> int:
        return self.ns

    def at(self, seconds: float) -> None:
        self.ns = round(seconds * S)

    def add(self, seconds: float) -> None:
        self.ns += round(seconds * S)


def recorder(tmp_path, role, rank=0, clock=None, cpu=None, **kwargs) -> Recorder:
    return Recorder(
        role, rank, fragment_path=fragment_path(str(tmp_path), role, rank), clock=clock or HandClock(),
        cpu_clock=cpu or HandClock(), **kwargs,
    )  # fmt: skip


def lay(rec, clock, name, start, end, category=names.BUSY, cpu_clock=None, cpu=None):
    """A span [start, end] seconds; with `cpu`, measured with `begin_cpu` and `cpu` CPU-seconds spent in it."""
    clock.at(start)
    if cpu is None:
        begun = rec.begin()
        clock.at(end)
        rec.end(name, begun, category)
    else:
        begun = rec.begin_cpu()
        clock.at(end)
        cpu_clock.add(cpu)
        rec.end_cpu(name, begun, category)


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def check_chrome_trace(trace: dict) -> None:
    """The trace-event schema Perfetto and chrome://tracing read, checked here independently of the library."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    named = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    tracks: dict[tuple, list] = {}
    for event in trace["traceEvents"]:
        assert event["ph"] in {"X", "M", "i"}, event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int) and isinstance(event["name"], str)
        if event["ph"] == "M":
            assert event["name"] in {"process_name", "process_sort_index", "process_labels", "thread_name"}
            assert isinstance(event["args"], dict)
            continue
        assert event["pid"] in named, f"unnamed process {event['pid']}"
        assert isinstance(event["ts"], int | float) and event["ts"] >= 0 and isinstance(event["cat"], str)
        if event["ph"] == "X":
            assert isinstance(event["dur"], int | float) and event["dur"] >= 0
            tracks.setdefault((event["pid"], event["tid"], event["cat"]), []).append(event)
        else:
            assert event["s"] in {"g", "p", "t"}
    spans_by_thread: dict[tuple, list] = {}
    for (pid, tid, category), events in tracks.items():
        if category == names.STEP:  # the recorded steps of a process follow each other without overlapping
            events = sorted(events, key=lambda e: (e["ts"], e["dur"]))
            for before, after in zip(events, events[1:], strict=False):
                assert before["ts"] + before["dur"] <= after["ts"] + 1e-6
        spans_by_thread.setdefault((pid, tid), []).extend(events)
    for events in spans_by_thread.values():  # one thread's slices nest: each ends before the one holding it
        open_ends = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            end = event["ts"] + event["dur"]
            while open_ends and open_ends[-1] <= event["ts"] + 1e-6:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-6, f"{event} overlaps a span without nesting in it"
            open_ends.append(end)


# ------------------------------------------------------------------------------------------------------ recording
def test_sampling_policy_keeps_the_first_steps_then_bursts():
    policy = SamplingPolicy(full_steps=3, every=10, burst=2)
    assert [s for s in range(31) if policy.keeps(s)] == [0, 1, 2, 3, 4, 13, 14, 23, 24]
    assert policy.keeps(-1)  # before the first step: start-up
    with pytest.raises(ValueError, match="burst"):
        SamplingPolicy(every=5, burst=6)


def test_spans_are_kept_when_they_overlap_a_kept_step(tmp_path):
    """Policy: 1 step in full, then 1 of every 4; first step 10. Kept: 10, 11, 15 (from the start: 0, 1, 5)."""
    clock = HandClock()
    policy = SamplingPolicy(full_steps=1, every=4, burst=1)
    rec = recorder(tmp_path, names.TRAINER, clock=clock, policy=policy, first_step=10)
    for step in range(10, 16):
        clock.at(step - 10)
        rec.set_step(step)
        if step == 11:
            out_of_kept = (clock.at(1.5), rec.begin())[1]
        if step == 12:
            lay(rec, clock, "inside 12", 2.1, 2.2)
        if step == 13:
            rec.end("began in 11, ended in 13", out_of_kept)
            into_kept = (clock.at(3.5), rec.begin())[1]
            between_dropped = rec.begin()
        if step == 14:
            rec.end("began in 13, ended in 14", between_dropped)
        if step == 15:
            clock.at(5.5)
            rec.end("began in 13, ended in 15", into_kept)
    rec.close()
    with open(rec.fragment_path) as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["header"]["role"] == "trainer" and lines[0]["header"]["first_step"] == 10
    spans = [s[0] for line in lines[1:] for s in line["spans"]]
    assert spans == ["began in 11, ended in 13", "began in 13, ended in 15"]
    steps = [(s[0], s[1] / S, s[2] / S) for line in lines[1:] for s in line["steps"]]
    assert steps == [(None, 0, 0), (10, 0, 1), (11, 1, 2), (15, 5, 5.5)]


def test_flushes_append_without_losing_or_repeating_spans(tmp_path):
    clock = HandClock()
    rec = recorder(tmp_path, names.GENERATOR, clock=clock)
    lay(rec, clock, "a", 0, 1)
    rec.flush()
    lay(rec, clock, "b", 1, 2)
    rec.instant(names.READY)
    rec.flush()
    rec.flush()  # nothing new: no span line
    lay(rec, clock, "c", 2, 3)
    rec.close()
    rec.close()  # idempotent
    with open(rec.fragment_path) as f:
        lines = [json.loads(line) for line in f]
    assert sum("header" in line for line in lines) == 1
    assert [s[0] for line in lines for s in line.get("spans", [])] == ["a", "b", "c"]
    assert [i[0] for line in lines for i in line.get("instants", [])] == [names.READY]


def test_disabled_recorder_records_nothing(tmp_path):
    rec = disabled()
    assert current() is rec  # nothing set: the process records nothing
    start = rec.begin()
    rec.end(names.DECODE, start)
    with rec.span(names.PREFILL):
        pass
    rec.add(names.STARTUP_SPAN, 0, 10)
    rec.end_cpu(names.GENERATE, rec.begin_cpu())
    rec.instant(names.READY)
    rec.set_step(1)
    rec.flush()
    rec.close()
    assert start == 0 and rec.chunks() == [] and not rec.enabled
    assert list(tmp_path.iterdir()) == []
    assert write_timeline(str(tmp_path)) is None  # no fragment, no file


def test_a_disabled_run_touches_nothing_and_the_first_step_defaults_to_the_first_one_entered(tmp_path):
    (tmp_path / FRAGMENT_DIR).mkdir()
    (tmp_path / FRAGMENT_DIR / "trainer-rank0.jsonl").write_text("kept\n")
    assert trainer_recorder(str(tmp_path), 0, 1, enabled=False) is disabled()
    assert (tmp_path / FRAGMENT_DIR / "trainer-rank0.jsonl").read_text() == "kept\n"
    clock = HandClock()
    rec = recorder(tmp_path, names.TRAINER, clock=clock, policy=SamplingPolicy(full_steps=2, every=10, burst=0),
                   first_step=None)  # fmt: skip
    for step in (500, 501, 502):  # a resumed run starting at 500 keeps 500 and 501 in full
        clock.at(step - 499)
        rec.set_step(step)
    clock.at(4)
    rec.close()
    assert rec.first_step == 500
    steps = [e["args"]["step"] for e in load(write_timeline(str(tmp_path)))["traceEvents"] if e.get("cat") == "step"]
    assert steps == [None, 500, 501]


# ------------------------------------------------------------------------------------------------------ analysis
def record_async_rank(tmp_path) -> str:
    """Trainer and generator of rank 0, one hand-driven clock (one host). Seconds:

    trainer   steps 0 [0,4], 1 [4,10]; forward + backward [0,3], optimizer step [3,4], wait for batch [4,6] (wait),
              forward + backward [6,9], nothing [9,10].
    generator created at 0.5 (start-up window [0.5,1]); marks spawn 0.2, imports done 0.5, model built 0.8, ready 1.0,
              first batch queued 5.0; start-up span [0.2,1]; version 0 [1,5], 1 [5,10]; decode [1,5],
              gate wait [5,8] (wait), rewards [8,9.5], nothing [9.5,10]."""
    clock = HandClock()
    trainer = recorder(tmp_path, names.TRAINER, clock=clock, cores=2)
    clock.at(0.5)
    generator = recorder(tmp_path, names.GENERATOR, clock=clock, cores=2)
    generator.instant(names.SPAWN, at_ns=round(0.2 * S))
    generator.instant(names.IMPORTS_DONE)
    clock.at(0.8)
    generator.instant(names.MODEL_BUILT)
    clock.at(1.0)
    generator.instant(names.READY)
    generator.add(names.STARTUP_SPAN, round(0.2 * S), clock(), names.STARTUP)
    clock.at(0)
    trainer.set_step(0)
    lay(trainer, clock, names.FORWARD_BACKWARD, 0, 3)
    lay(trainer, clock, names.OPTIMIZER_STEP, 3, 4)
    trainer.set_step(1)
    lay(trainer, clock, names.WAIT_FOR_BATCH, 4, 6, names.WAIT)
    lay(trainer, clock, names.FORWARD_BACKWARD, 6, 9)
    clock.at(1)
    generator.set_step(0)
    lay(generator, clock, names.DECODE, 1, 5)
    generator.instant(names.FIRST_BATCH_QUEUED)
    generator.set_step(1)
    lay(generator, clock, names.GATE_WAIT, 5, 8, names.WAIT)
    lay(generator, clock, names.REWARDS, 8, 9.5)
    clock.at(10)
    generator.close()
    trainer.close()
    return write_timeline(str(tmp_path))


def test_summary_of_an_async_rank_matches_the_figures_worked_by_hand(tmp_path):
    summary = summarize(record_async_rank(tmp_path))
    trainer, generator = summary["processes"]["trainer rank 0"], summary["processes"]["generator rank 0"]
    # Trainer: recorded [0,10]; busy [0,4] + [6,9] = 7 s; wait for batch 2 s; untracked [9,10].
    assert trainer["recorded_s"] == pytest.approx(10)
    assert trainer["busy_fraction"] == pytest.approx(0.7)
    assert trainer["wait_s"] == pytest.approx({names.WAIT_FOR_BATCH: 2.0})
    assert trainer["untracked_s"] == pytest.approx(1.0)
    assert trainer["steps_recorded"] == 2 and not trainer["truncated"]
    # Generator: recorded [0.5,10] = 9.5 s; busy [0.5,1] (start-up, clipped) + [1,5] + [8,9.5] = 6 s.
    assert generator["recorded_s"] == pytest.approx(9.5)
    assert generator["busy_fraction"] == pytest.approx(6.0 / 9.5)
    assert generator["wait_s"] == pytest.approx({names.GATE_WAIT: 3.0})
    assert generator["untracked_s"] == pytest.approx(0.5)
    # Both busy: [0.5,4] + [8,9] = 4.5 s of the 9.5 s both were recorded.
    assert summary["overlap"][0]["both_busy_s"] == pytest.approx(4.5)
    assert summary["overlap"][0]["fraction"] == pytest.approx(4.5 / 9.5)
    causes = [(c["process"], c["cause"], round(c["seconds"], 6)) for c in summary["idle_causes"]]
    assert causes == [
        ("generator rank 0", names.GATE_WAIT, 3.0),
        ("trainer rank 0", names.WAIT_FOR_BATCH, 2.0),
        ("trainer rank 0", "untracked", 1.0),
        ("generator rank 0", "untracked", 0.5),
    ]
    # Start-up: spawn 0.2 -> first batch queued 5.0.
    start = summary["startup"][0]
    assert start["total_s"] == pytest.approx(4.8)
    assert [(p["from"], p["to"], round(p["seconds"], 6)) for p in start["phases"]] == [
        (names.SPAWN, names.IMPORTS_DONE, 0.3),
        (names.IMPORTS_DONE, names.MODEL_BUILT, 0.3),
        (names.MODEL_BUILT, names.READY, 0.2),
        (names.READY, names.FIRST_BATCH_QUEUED, 4.0),
    ]
    assert summary["sync"] is None  # a generation process ran: not a synchronous run


def test_trace_has_one_origin_and_names_every_process(tmp_path):
    trace = load(record_async_rank(tmp_path))
    check_chrome_trace(trace)
    events = trace["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert process_names == {100: "trainer rank 0", 101: "generator rank 0"}
    # One origin, the earliest event (the trainer's start at 0 s): the generator's decode starts at 1 s, its spawn
    # mark at 0.2 s, the trainer's wait at 4 s, all in microseconds.
    by_name = {(e["pid"], e["name"]): e for e in events if e["ph"] in ("X", "i")}
    assert by_name[(101, names.DECODE)]["ts"] == 1_000_000 and by_name[(101, names.DECODE)]["dur"] == 4_000_000
    assert by_name[(101, names.SPAWN)]["ts"] == 200_000
    assert by_name[(100, names.WAIT_FOR_BATCH)]["ts"] == 4_000_000
    assert by_name[(100, names.WAIT_FOR_BATCH)]["cat"] == names.WAIT
    assert by_name[(100, "step 1")]["args"]["step"] == 1 and by_name[(100, "step 1")]["dur"] == 6_000_000


def test_sync_limit_matches_the_figures_worked_by_hand(tmp_path):
    """One process doing both in turn. Per step (4 s): score [0,2.5] holding generate [0,2] (3 CPU-s: 1.5 cores),
    forward + backward [2.5,3.5] (1.8 CPU-s), optimizer step [3.5,3.7], nothing to 4. Two steps, 2 cores.

    G = 2 x 2 = 4 s; T = 2 x (0.5 of score outside generate + 1 + 0.2) = 3.4 s; W = 8 s.
    ideal = (4 + 3.4) / 4 = 1.85; Amdahl = 8 / (8 - 3.4); cores: generation 6 / 4 = 1.5, training 3.6 / 2 = 1.8;
    bounded by the cores: 7.4 / max(4, 3.4, (6 + 3.6) / 2 = 4.8) = 7.4 / 4.8; core-seconds 9.6 / (8 x 2) = 0.6."""
    clock, cpu = HandClock(), HandClock()
    rec = recorder(tmp_path, names.TRAINER, clock=clock, cpu=cpu, cores=2)
    for step, t in ((0, 0.0), (1, 4.0)):
        clock.at(t)
        rec.set_step(step)
        score = rec.begin()
        lay(rec, clock, names.GENERATE, t, t + 2, cpu_clock=cpu, cpu=3.0)
        clock.at(t + 2.5)
        rec.end(names.SCORE, score)
        lay(rec, clock, names.FORWARD_BACKWARD, t + 2.5, t + 3.5, cpu_clock=cpu, cpu=1.8)
        lay(rec, clock, names.OPTIMIZER_STEP, t + 3.5, t + 3.7)
    clock.at(8)
    rec.close()
    path = write_timeline(str(tmp_path))
    limit = sync_limit(path)
    assert limit["generation_s"] == pytest.approx(4.0) and limit["training_s"] == pytest.approx(3.4)
    assert limit["wall_s"] == pytest.approx(8.0)
    assert limit["ideal_overlap_ratio"] == pytest.approx(1.85) and ideal_overlap_ratio(path) == pytest.approx(1.85)
    assert limit["amdahl_ratio"] == pytest.approx(8 / 4.6)
    assert limit["generation_cores"] == pytest.approx(1.5) and limit["training_cores"] == pytest.approx(1.8)
    assert limit["cpu_bound_ratio"] == pytest.approx(7.4 / 4.8)
    assert limit["core_busy_fraction"] == pytest.approx(0.6)
    assert summarize(path)["sync"]["ideal_overlap_ratio"] == pytest.approx(1.85)


def test_an_async_trace_has_no_sync_limit(tmp_path):
    with pytest.raises(ValueError, match="not a sync run"):
        ideal_overlap_ratio(record_async_rank(tmp_path))


def test_spans_that_overlap_without_nesting_go_to_their_own_thread(tmp_path):
    """Viewers drop a thread's slices that overlap without nesting: [1,3] starts inside [0,2] and ends after it, so
    it moves to thread 3; [0.5,1] nests in [0,2] and stays. Busy time is their union, [0,3], all the same."""
    clock = HandClock()
    rec = recorder(tmp_path, names.TRAINER, clock=clock)
    rec.add("outer", 0, 2 * S)
    rec.add("overlapping", 1 * S, 3 * S)
    rec.add("nested", S // 2, 1 * S)
    # Ends rounded to 0.1 us alike: [0.149, 1.149] us -> [0.1, 1.1]; [0.151, 1.149] -> [0.2, 1.1], still inside
    # (rounding the duration instead, 0.998 us -> 1.0, would end it at 1.2, past its parent).
    rec.add("parent", 149, 1149)
    rec.add("child", 151, 1149)
    clock.at(3)
    rec.close()
    path = write_timeline(str(tmp_path))
    trace = load(path)
    check_chrome_trace(trace)
    threads = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != names.STEP}
    assert threads == {"outer": 1, "nested": 1, "overlapping": 3, "parent": 1, "child": 1}
    assert summarize(path)["processes"]["trainer rank 0"]["busy_s"] == pytest.approx(3.0)


# ------------------------------------------------------------------------------------------------------ merging
def fragment_lines(header: dict, *chunks: dict) -> str:
    return "\n".join(json.dumps(x) for x in ({"header": header}, *chunks)) + "\n"


def header(role, rank, boot, mono, unix, world_size=2):
    return {"format": 1, "role": role, "rank": rank, "world_size": world_size, "os_pid": 1000 + rank, "host": boot,
            "boot_id": boot, "cores": 2, "clock": {"monotonic_ns": mono, "unix_ns": unix}}  # fmt: skip


def test_hosts_are_aligned_by_their_own_trainers_clock_and_stale_ranks_ignored(tmp_path):
    """Host a: trainer 0, monotonic 1 s = Unix 5000 s; a span at monotonic [2,3] s is Unix [5001,5002].
    Host b: trainer 1, monotonic 50 s = Unix 5000.5 s; its span at [51,52] is Unix 5001.5. Its generator's own pair
    is 10 s off (a skewed wall clock): it is placed by its trainer's pair, [51.2,51.4] -> Unix 5001.7. Origin: the
    earliest event, Unix 5001. A fragment of rank 2 (a previous run with 3 ranks) is ignored; a torn line skipped."""
    folder = tmp_path / FRAGMENT_DIR
    folder.mkdir()
    span = lambda name, a, b: {"spans": [[name, "busy", round(a * S), round(b * S)]]}  # noqa: E731
    (folder / "trainer-rank0.jsonl").write_text(
        fragment_lines(header("trainer", 0, "a", 1 * S, 5000 * S), span(names.FORWARD_BACKWARD, 2, 3))
    )
    (folder / "trainer-rank1.jsonl").write_text(
        fragment_lines(header("trainer", 1, "b", 50 * S, 5000_500_000_000), span(names.FORWARD_BACKWARD, 51, 52))
        + '{"spans": [["torn'
    )
    (folder / "generator-rank1.jsonl").write_text(
        fragment_lines(header("generator", 1, "b", 50 * S, 5010_500_000_000), span(names.DECODE, 51.2, 51.4))
    )
    (folder / "trainer-rank2.jsonl").write_text(
        fragment_lines(header("trainer", 2, "c", 0, 0, world_size=3), span(names.FORWARD_BACKWARD, 0, 1))
    )
    trace = load(write_timeline(str(tmp_path)))
    check_chrome_trace(trace)
    spans = {(e["pid"], e["name"]): (e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans == {
        (100, names.FORWARD_BACKWARD): (0.0, 1_000_000.0),
        (200, names.FORWARD_BACKWARD): (500_000.0, 1_000_000.0),
        (201, names.DECODE): (700_000.0, 200_000.0),
    }
    assert trace["otherData"]["trl_async_timeline"]["hosts"] == 2


def test_a_real_child_process_hands_its_spans_over(tmp_path):
    """A spawned child records as the generation process will (its own fragment, same clock, the `TimelineSpec` it
    is handed); the parent records the spawn and its own batches; the merged trace places the child's spans between
    the parent's spawn and join. A previous run's fragments in the folder do not leak in."""
    output_dir = str(tmp_path)
    folder = tmp_path / FRAGMENT_DIR
    folder.mkdir()
    stale = fragment_lines(header("generator", 0, "x", 0, 0, world_size=2), {"spans": [["old", "busy", 0, 1]]})
    (folder / "generator-rank0.jsonl").write_text(stale)  # this rank's: removed when its run starts
    (folder / "generator-rank1.jsonl").write_text(stale.replace('"rank": 0', '"rank": 1'))  # beyond the world size
    trainer = trainer_recorder(output_dir, rank=0, world_size=1)
    assert sorted(os.listdir(folder)) == ["generator-rank1.jsonl"]
    trainer.set_step(3)  # a resumed run: the policy counts from its first step
    from tests.support.timeline_child import generator_main

    spawn_ns = trainer.begin()
    spec = TimelineSpec(output_dir, policy=SamplingPolicy(full_steps=10), first_step=trainer.first_step,
                        spawn_ns=spawn_ns)  # fmt: skip
    child = multiprocessing.get_context("spawn").Process(target=generator_main, args=(pickle.dumps(spec), 0, 1))
    child.start()
    trainer.end("spawn generator", spawn_ns)
    with trainer.span(names.MAKE_BATCH):
        child.join(60)
    trainer.close()
    assert child.exitcode == 0
    first = write_timeline(output_dir)
    assert write_timeline(output_dir) == first  # rewritten in place (os.replace), nothing left beside it
    assert sorted(os.listdir(output_dir)) == [FRAGMENT_DIR, "timeline.json"]
    trace = load(first)
    check_chrome_trace(trace)
    events = trace["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert process_names == {100: "trainer rank 0", 101: "generator rank 0"}
    assert not [e for e in events if e["name"] == "old"]  # the previous run's fragment was removed
    described = {p["pid"]: p for p in trace["otherData"]["trl_async_timeline"]["processes"]}
    assert described[101]["os_pid"] == child.pid and described[100]["os_pid"] == os.getpid()
    spawn = next(e for e in events if e["name"] == "spawn generator")
    waited = next(e for e in events if e["name"] == names.MAKE_BATCH)
    child_events = [e for e in events if e["pid"] == 101 and e["ph"] in ("X", "i") and e["cat"] != names.STEP]
    assert {e["name"] for e in child_events} >= {names.DECODE, names.WRITE_BATCH, names.SPAWN, names.READY}
    spawn_mark = next(e for e in child_events if e["name"] == names.SPAWN)
    assert spawn_mark["ts"] == spawn["ts"]  # the parent's clock reading, placed on the same axis
    for event in child_events:
        assert spawn["ts"] <= event["ts"] and event["ts"] + event.get("dur", 0) <= waited["ts"] + waited["dur"] + 0.2
    steps = [e["args"]["step"] for e in events if e["pid"] == 101 and e.get("cat") == names.STEP]
    assert steps == [None, 3, 4]
    assert summarize(first)["startup"][0]["total_s"] > 0


def test_merges_are_spaced_by_the_interval_and_by_their_own_cost():
    """Merges at log steps wait 60 s, and 1,000 times the last merge's duration (0.1% of the run): a merge that took
    1 s allows the next one 1,000 s after it ended. The final `write` always merges."""
    clock, merged = HandClock(), []

    def merge(output_dir):  # takes 1 s on the hand clock
        merged.append(clock() / S)
        clock.add(1.0)
        return output_dir

    writer = TimelineWriter("run", min_interval_s=60.0, max_share=0.001, merge=merge, clock=lambda: clock() / S)
    for t in (10, 59.9, 60, 100, 1060, 1061, 1100):
        clock.at(t)
        writer.maybe_write()
    clock.at(1200)
    writer.write()
    assert merged == [60, 1061, 1200]  # 60: first due; 1061 = 61 (end of the first) + 1,000; the last: forced


# ------------------------------------------------------------------------------------------------------ the bound
def test_ten_thousand_steps_stay_within_five_megabytes(tmp_path):
    """Default policy: steps 0-199, then 5 of every 100 (200-204, 300-304, ..., 9900-9904): 200 + 98 x 5 = 690
    steps per process, with 12 trainer and 8 generator spans per step (20 per step)."""
    clock = HandClock()
    trainer = recorder(tmp_path, names.TRAINER, clock=clock)
    generator = recorder(tmp_path, names.GENERATOR, clock=clock)
    trainer_spans = [names.WAIT_FOR_BATCH, names.SCORE, *[names.FORWARD_BACKWARD] * 8, names.OPTIMIZER_STEP,
                     names.PUBLISH_WEIGHTS]  # fmt: skip
    generator_spans = [names.GATE_WAIT, names.LOAD_WEIGHTS, names.TOKENIZE, names.PREFILL, names.DECODE,
                       names.REWARDS, names.WRITE_BATCH, names.LOG]  # fmt: skip
    for step in range(10_000):
        t = 0.3 * step
        clock.at(t)
        trainer.set_step(step)
        generator.set_step(step)
        for i, name in enumerate(trainer_spans):
            lay(trainer, clock, name, t + 0.02 * i, t + 0.02 * i + 0.01)
        for i, name in enumerate(generator_spans):
            lay(generator, clock, name, t + 0.03 * i, t + 0.03 * i + 0.02)
        if step % 500 == 0:
            trainer.flush()
            generator.maybe_flush()
    clock.at(3000)
    trainer.close()
    generator.close()
    path = write_timeline(str(tmp_path))
    size = os.path.getsize(path)
    assert size < 5_000_000, f"{size / 1e6:.1f} MB"
    trace = load(path)
    check_chrome_trace(trace)
    kept = [*range(200), *(s for block in range(200, 10_000, 100) for s in range(block, block + 5))]
    assert len(kept) == 690
    for pid, per_step in ((100, len(trainer_spans)), (101, len(generator_spans))):
        steps = [e for e in trace["traceEvents"] if e["pid"] == pid and e.get("cat") == names.STEP]
        assert [e["args"]["step"] for e in sorted(steps, key=lambda e: (e["ts"], e["dur"]))] == [None, *kept]
        spans = [e for e in trace["traceEvents"] if e["pid"] == pid and e["ph"] == "X" and e["cat"] != names.STEP]
        assert len(spans) == 690 * per_step


def test_max_events_stops_a_runaway_recording(tmp_path):
    clock = HandClock()
    rec = recorder(tmp_path, names.TRAINER, clock=clock, policy=SamplingPolicy(max_events=25))
    for step in range(10):
        clock.at(step)
        rec.set_step(step)
        for _ in range(10):
            lay(rec, clock, names.DECODE, step + 0.1, step + 0.2)
    rec.close()
    spans = [e for e in load(write_timeline(str(tmp_path)))["traceEvents"] if e["name"] == names.DECODE]
    assert len(spans) == 30  # steps 0-2 recorded (the cap is checked when a step starts), then nothing
    assert rec.truncated and summarize(str(tmp_path))["processes"]["trainer rank 0"]["truncated"]


# ------------------------------------------------------------------------------------------------------ gantt, CLI
def record_steps(tmp_path, count: int) -> str:
    """A trainer whose step s is [s, s+1] s, with a forward + backward [s, s+0.6] and a wait [s+0.6, s+0.9]."""
    clock = HandClock()
    rec = recorder(tmp_path, names.TRAINER, clock=clock)
    for step in range(count):
        clock.at(step)
        rec.set_step(step)
        lay(rec, clock, names.FORWARD_BACKWARD, step, step + 0.6)
        lay(rec, clock, names.WAIT_FOR_BATCH, step + 0.6, step + 0.9, names.WAIT)
    clock.at(count)
    rec.close()
    return write_timeline(str(tmp_path))


def test_gantt_window_is_the_steps_asked_for_or_the_middle_ten(tmp_path):
    path = record_steps(tmp_path, 30)
    assert step_window(path, (2, 3)) == pytest.approx((2.0, 4.0))
    assert step_window(path) == pytest.approx((10.0, 20.0))  # steps 10-19: the middle 10 of 0-29
    with pytest.raises(ValueError, match="no recorded step"):
        step_window(path, (40, 41))
    png = tmp_path / "gantt.png"
    assert draw_gantt(path, str(png), "5:6") == pytest.approx((5.0, 7.0))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trl_async.timeline", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_cli_prints_the_figures_and_draws_the_chart(tmp_path):
    record_async_rank(tmp_path)
    result = run_cli(str(tmp_path), "--steps", "0:1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "trainer rank 0" in out and " 70.0% of 10.000 s" in out  # 7 of 10 s
    assert " 63.2% of 9.500 s" in out  # 6 of 9.5 s
    assert "rank 0" in out and " 47.4% (4.500 s of 9.500 s)" in out  # 4.5 of 9.5 s
    assert out.index(names.GATE_WAIT) < out.index(names.WAIT_FOR_BATCH)  # 3 s before 2 s
    assert "spawn to first batch queued 4.800 s" in out
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_merges_the_fragments_of_a_run_that_died_and_reports_a_sync_limit(tmp_path):
    test_sync_limit_matches_the_figures_worked_by_hand(tmp_path)
    os.remove(tmp_path / "timeline.json")  # the run was killed before writing it: its fragments remain
    result = run_cli(str(tmp_path), "--no-png", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["sync"]["ideal_overlap_ratio"] == pytest.approx(1.85)
    assert (tmp_path / "timeline.json").exists() and not (tmp_path / "timeline.png").exists()


def test_the_library_imports_without_matplotlib_or_torch():
    code = "import sys, trl_async.timeline; print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_cli_help_exits_zero():
    result = run_cli("--help")
    assert result.returncode == 0 and "--steps" in result.stdout and "Perfetto" in result.stdout


# ----------------------------------------------------------------------------------------------- in a real run
def _docs_style_run(tmp_path, **overrides):
    from trl import GRPOConfig

    from tests.support.trainer_utils import answer_reward
    from trl_async import AsyncGRPOTrainer
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=16, max_steps=40, report_to="none", bf16=False, logging_steps=10,
                      save_strategy="no", **overrides)  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(), reward_funcs=answer_reward, args=args,
        train_dataset=make_arithmetic_dataset(num_train=128, num_test=4)["train"],
    )  # fmt: skip
    started_unix = time.time()
    trainer.train()
    return args.output_dir, started_unix, time.time()


def test_a_docs_style_run_writes_a_timeline_of_both_processes_covering_the_run(tmp_path):
    """A plain-`GRPOConfig` script writes `OUTPUT_DIR/timeline.json`: a trace-event file with spans of the trainer and
    of its generation process (two pids, named by role and rank), whose wall-clock extent lies within the run and
    covers most of it, with the generator's start-up marks and the trainer's training spans."""
    output_dir, started, ended = _docs_style_run(tmp_path)
    trace = json.loads((pathlib.Path(output_dir) / "timeline.json").read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"trainer rank 0", "generator rank 0"} <= names, names
    spans = [e for e in events if e["ph"] == "X"]
    pids = {e["pid"] for e in spans}
    assert len(pids) >= 2
    generator_pid = next(e["pid"] for e in events if e["ph"] == "M" and e["args"].get("name") == "generator rank 0")
    assert {"decode", "load weights", "gate wait"} <= {e["name"] for e in spans if e["pid"] == generator_pid}
    by_name = {e["name"] for e in spans}
    assert {"forward + backward", "optimizer step", "score", "decode", "prefill", "rewards"} <= by_name, by_name
    assert {e["name"] for e in events if e["ph"] == "i"} >= {"spawn", "ready", "first batch queued"}
    assert all(e["dur"] >= 0 for e in spans)
    # Wall-clock coverage: the trace's extent (microseconds on one axis) against the run's own wall time.
    first, last = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    extent_s = (last - first) / 1e6
    assert extent_s <= (ended - started) + 1.0
    assert extent_s >= 0.5 * (ended - started), (extent_s, ended - started)
    summary = timeline.summarize(output_dir)
    assert summary["startup"] and summary["overlap"][0]["both_busy_s"] > 0
    for process in ("trainer rank 0", "generator rank 0"):  # each process's own peak memory (a model: > 50 MiB)
        assert summary["processes"][process]["peak_rss_bytes"] > 50 * 2**20


def test_timeline_false_records_nothing(tmp_path):
    from tests.support.trainer_utils import length_reward, load_model, load_tokenizer, make_args
    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.toy import make_arithmetic_dataset

    args = make_args(tmp_path, config_cls=AsyncGRPOConfig, max_steps=3, timeline=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, processing_class=load_tokenizer(),
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=4)["train"],
    )  # fmt: skip
    trainer.train()
    out = pathlib.Path(args.output_dir)
    assert not (out / "timeline.json").exists() and not (out / "_timeline-fragments").exists()
