"""What recording a timeline costs (`trl_async.timeline`): nanoseconds per span on the hot path, and the fraction
of a training step that is, at the tiny model's step times.

    python benchmarks/bench_timeline_overhead.py            # ~10 s; writes results/bench_timeline_overhead.json

Measured, each as the fastest of several repeats of a tight loop (the least disturbed one; the loop's own cost is
included, so the figures are upper bounds):

* `begin()` + `end(name, start)` in a kept step, the path every span takes;
* the same in a step the sampling policy drops, and `with rec.span(name):`;
* the disabled recorder (`timeline=False`), both ways;
* `set_step` (once per step: two clock reads, the CPU clock included);
* `flush`, per span (JSON, one append to the fragment), and one merge of a bounded 10,000-step run of one trainer
  and its generator (20 spans per step) into timeline.json.

The overhead of a step = 20 spans + one `set_step` + 20 spans' flush, over the tiny model's step time (0.2-0.5 s on
the development machine). The merge is not per step: `TimelineWriter` merges at log steps once 60 s and 1,000 times
the last merge's duration have passed, so its share is the merge time over max(60 s, 1,000 x the merge time), at
most 0.1%, and at the end. These are upper bounds by construction; a paired end-to-end comparison (timeline on
vs off) cannot resolve 1% on this machine, whose paired ratios of identical runs spread by several percent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_async.timeline import Recorder, SamplingPolicy, disabled, fragment_path, names, write_timeline  # noqa: E402

SPANS_PER_STEP = 20
STEP_TIMES_S = (0.2, 0.5)
MERGE_INTERVAL_S = 60.0  # `TimelineWriter`'s defaults
MERGE_MAX_SHARE = 0.001


def per_call_ns(body, calls: int = 200_000, repeats: int = 7) -> float:
    """Fastest of `repeats` runs of `body(calls)`, in ns per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        body(calls)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def kept_spans(recorder):
    def body(calls):
        begin, end = recorder.begin, recorder.end
        for _ in range(calls):
            start = begin()
            end("decode", start)
        if hasattr(recorder, "_events"):
            recorder._events.clear()  # keep memory flat between repeats (a real run flushes)

    return body


def context_spans(recorder):
    def body(calls):
        span = recorder.span
        for _ in range(calls):
            with span("decode"):
                pass
        if hasattr(recorder, "_events"):
            recorder._events.clear()

    return body


def steps(recorder):
    def body(calls):
        for step in range(calls):
            recorder.set_step(step)

    return body


def empty_loop(calls):
    for _ in range(calls):
        pass


def flush_ns_per_span(folder: str, spans: int = 4000, repeats: int = 5) -> float:
    recorder = Recorder(names.TRAINER, 0, fragment_path=fragment_path(folder, names.TRAINER, 0))
    best = float("inf")
    for _ in range(repeats):
        for _ in range(spans):
            recorder.end(names.FORWARD_BACKWARD, recorder.begin())
        start = time.perf_counter_ns()
        recorder.flush()
        best = min(best, (time.perf_counter_ns() - start) / spans)
    return best


def merge_seconds(folder: str, num_steps: int = 10_000) -> tuple[float, int]:
    """One merge of a bounded `num_steps`-step run (default policy), trainer + generator, 20 spans per step."""
    clock = [0]

    def now():
        return clock[0]

    trainer, generator = (
        Recorder(role, 0, fragment_path=fragment_path(folder, role, 0), clock=now)
        for role in (names.TRAINER, names.GENERATOR)
    )
    for step in range(num_steps):
        for recorder in (trainer, generator):
            clock[0] = step * 300_000_000
            recorder.set_step(step)
            for _ in range(SPANS_PER_STEP // 2):
                start = recorder.begin()
                clock[0] += 10_000_000
                recorder.end(names.DECODE, start)
    trainer.close()
    generator.close()
    start = time.perf_counter()
    path = write_timeline(folder)
    return time.perf_counter() - start, os.path.getsize(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--output", default=os.path.join(HERE, "results", "bench_timeline_overhead.json"), help="where to write"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        kept = Recorder(names.TRAINER, 0, fragment_path=os.path.join(folder, "kept.jsonl"))
        dropped = Recorder(names.TRAINER, 0, policy=SamplingPolicy(full_steps=0, every=10, burst=0))
        dropped.set_step(0)  # a dropped step (burst 0 keeps none)
        results = {
            "loop_only_ns": per_call_ns(empty_loop),
            "span_kept_ns": per_call_ns(kept_spans(kept)),
            "span_dropped_step_ns": per_call_ns(kept_spans(dropped)),
            "span_context_manager_ns": per_call_ns(context_spans(kept)),
            "disabled_span_ns": per_call_ns(kept_spans(disabled())),
            "disabled_context_manager_ns": per_call_ns(context_spans(disabled())),
            "set_step_ns": per_call_ns(
                steps(Recorder(names.TRAINER, 0, policy=SamplingPolicy(max_events=10**9))), 50_000
            ),
            "flush_ns_per_span": flush_ns_per_span(folder),
        }
        merge_s, trace_bytes = merge_seconds(os.path.join(folder, "run"))
    merge_every_s = max(MERGE_INTERVAL_S, merge_s / MERGE_MAX_SHARE)
    per_step_ns = SPANS_PER_STEP * (results["span_kept_ns"] + results["flush_ns_per_span"]) + results["set_step_ns"]
    overhead = {
        f"step_{step_s}s": {
            "recording_fraction": per_step_ns / (step_s * 1e9),
            "with_merges_fraction": per_step_ns / (step_s * 1e9) + merge_s / merge_every_s,
        }
        for step_s in STEP_TIMES_S
    }
    report = {
        "benchmark": "bench_timeline_overhead",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "spans_per_step": SPANS_PER_STEP,
        "per_call_ns": {k: round(v, 1) for k, v in results.items()},
        "per_step_ns": round(per_step_ns, 1),
        "merge_10k_steps_s": round(merge_s, 4),
        "merge_10k_steps_trace_mb": round(trace_bytes / 1e6, 3),
        "merge_every_s": round(merge_every_s, 1),
        "overhead": overhead,
    }
    print(f"per call (ns, fastest of 7 x 200,000, loop included; an empty loop costs {results['loop_only_ns']:.0f}):")
    for key, value in results.items():
        if key != "loop_only_ns":
            print(f"  {key:<28} {value:8.1f}")
    print(f"per step ({SPANS_PER_STEP} spans + set_step + their flush): {per_step_ns / 1000:.2f} us")
    print(f"merge of a bounded 10,000-step run (trainer + generator): {merge_s:.3f} s, {trace_bytes / 1e6:.2f} MB")
    for step_s in STEP_TIMES_S:
        figures = overhead[f"step_{step_s}s"]
        print(
            f"step of {step_s} s: recording {100 * figures['recording_fraction']:.4f}% of the step; with that merge every "
            f"{merge_every_s:.0f} s, {100 * figures['with_merges_fraction']:.3f}% (budget: 1%)"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return report


if __name__ == "__main__":
    main()
