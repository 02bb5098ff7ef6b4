"""`python -m trl_async.timeline OUTPUT_DIR`: where the time of a run went (see docs/timeline.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .analysis import summarize
from .trace import resolve

DESCRIPTION = """\
Summarize a run's timeline (OUTPUT_DIR/timeline.json, written by the trainer; or the fragments under
OUTPUT_DIR/_timeline-fragments/ of a run that stopped before writing it, merged first) and draw a Gantt chart.

Prints, over each process's recorded steps: its busy fraction; per rank, the overlap (time trainer and generator
are both busy, over the wall time); the top idle causes (named wait spans and untracked gaps, by total time); the
generation process's start-up (spawn to first batch queued); for a synchronous run, the limit: the ideal overlap
ratio (generation + training) / max(generation, training) and, where CPU time was recorded, the core usage.
Open timeline.json itself in Perfetto (https://ui.perfetto.dev) or chrome://tracing."""


def format_summary(summary: dict) -> str:
    lines = ["busy fraction (union of busy spans / recorded wall time):"]
    for label, figures in summary["processes"].items():
        cpu = figures["cpu_cores_busy_fraction"]
        lines.append(
            f"  {label:<20} {100 * figures['busy_fraction']:5.1f}% of {figures['recorded_s']:.3f} s "
            f"({figures['steps_recorded']} steps recorded)"
            + ("" if cpu is None else f", CPU {100 * cpu:.1f}% of cores")
            + ("" if not figures.get("peak_rss_bytes") else f", peak RSS {figures['peak_rss_bytes'] / 2**20:.0f} MiB")
            + (" [recording stopped early: max_events]" if figures["truncated"] else "")
        )
    if summary["overlap"]:
        lines.append("overlap (trainer and generator busy at once / wall time both recorded):")
        for rank, overlap in summary["overlap"].items():
            lines.append(
                f"  rank {rank:<15} {100 * overlap['fraction']:5.1f}% ({overlap['both_busy_s']:.3f} s of "
                f"{overlap['wall_s']:.3f} s)"
            )
    lines.append("top idle causes:")
    for cause in summary["idle_causes"] or [{"process": "-", "cause": "none", "seconds": 0.0, "fraction": 0.0}]:
        lines.append(
            f"  {cause['process']:<20} {cause['cause']:<18} {cause['seconds']:9.3f} s "
            f"({100 * cause['fraction']:.1f}% of its time)"
        )
    for rank, start in summary["startup"].items():
        total = "not reached" if start["total_s"] is None else f"{start['total_s']:.3f} s"
        phases = ", ".join(f"{p['from']} -> {p['to']} {p['seconds']:.3f} s" for p in start["phases"])
        lines.append(f"start-up of generator rank {rank}: spawn to first batch queued {total} ({phases})")
    sync = summary["sync"]
    if sync is not None:
        lines.append(
            f"limit (synchronous run): generation {sync['generation_s']:.3f} s, training {sync['training_s']:.3f} s "
            f"of {sync['wall_s']:.3f} s: ideal overlap ratio {sync['ideal_overlap_ratio']:.3f}x"
            + ("" if sync["amdahl_ratio"] is None else f" ({sync['amdahl_ratio']:.3f}x with the rest serial)")
        )
        if "cpu_bound_ratio" in sync:
            lines.append(
                f"  cores busy: generation {sync['generation_cores']:.2f}, training {sync['training_cores']:.2f}; "
                f"bounded by the cores: {sync['cpu_bound_ratio']:.3f}x"
            )
        if "core_busy_fraction" in sync:
            lines.append(f"  core-seconds busy: {100 * sync['core_busy_fraction']:.1f}% of wall x cores")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trl_async.timeline",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="the run's output_dir (holding timeline.json) or a timeline.json")
    parser.add_argument("--png", help="where to draw the Gantt chart (default: timeline.png beside the trace)")
    parser.add_argument("--no-png", action="store_true", help="do not draw the Gantt chart")
    parser.add_argument("--steps", help="the chart's window, steps A:B of trainer rank 0 (default: 10 middle steps)")
    parser.add_argument("--top", type=int, default=10, help="idle causes listed (default 10)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of text")
    args = parser.parse_args(argv)
    try:
        trace_path = resolve(args.path)
        summary = summarize(trace_path, top=args.top)
    except (OSError, ValueError, KeyError) as error:
        print(f"python -m trl_async.timeline: {args.path}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if not args.no_png:
        png = args.png or os.path.join(os.path.dirname(os.path.abspath(trace_path)), "timeline.png")
        try:
            from .gantt import draw_gantt

            start, end = draw_gantt(trace_path, png, args.steps)
        except ImportError:
            print("(no Gantt chart: matplotlib is not installed; pip install matplotlib)", file=sys.stderr)
        else:
            print(f"gantt: {png} ({start:.3f} s to {end:.3f} s)", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
