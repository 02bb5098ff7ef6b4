"""A benchmark run's timeline, summarized for its results file (shared by bench_docs_style.py and bench_main_job.py)."""

from __future__ import annotations

import os


def timeline_figures(output_dir: str, sync: bool) -> dict | None:
    """The run's timeline (`trl_async.timeline`), summarized: where the time went; for the synchronous run (the same
    trainer with `async_generation=False`), the limit of overlapping its generation with its training. None without
    a timeline (TRL's own trainer records none)."""
    from trl_async import timeline

    if not os.path.exists(os.path.join(output_dir, timeline.TIMELINE_FILE)):
        return None
    summary = timeline.summarize(output_dir)
    figures = {
        "busy_fraction": {name: p["busy_fraction"] for name, p in summary["processes"].items()},
        "overlap_fraction": {str(rank): o["fraction"] for rank, o in summary["overlap"].items()},
        "idle_causes": summary["idle_causes"][:5],
        "startup": summary["startup"],
    }
    if sync:
        figures["limit"] = timeline.sync_limit(output_dir)
    return figures
