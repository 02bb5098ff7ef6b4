"""A Gantt chart of a window of steps: one row per process, one colour per span name, waits hatched, nested spans
drawn thinner on top of the span holding them, start-up marks as ticks, the reference trainer's step boundaries as
dotted lines. matplotlib (Agg) is imported only here, when a picture is drawn."""

from __future__ import annotations

from . import names as n
from .analysis import processes
from .names import TRAINER, WAIT
from .trace import load_trace

DEFAULT_STEPS = 10
# Fixed colours, so that a span has the same one in every picture: tab10's (red and grey kept for waits), then
# tab20's light shades. Waits are red/grey and hatched. Names not listed take the colours left, in name order.
BUSY_ORDER = (n.FORWARD_BACKWARD, n.OPTIMIZER_STEP, n.SCORE, n.PUBLISH_WEIGHTS, n.MAKE_BATCH, n.DECODE, n.PREFILL,
              n.REWARDS, n.WRITE_BATCH, n.LOAD_WEIGHTS, n.TOKENIZE, n.STARTUP_SPAN, n.GENERATE, n.TRAIN, n.LOG,
              n.SAVE_CHECKPOINT, n.TOOLS)  # fmt: skip
WAIT_ORDER = (n.WAIT_FOR_BATCH, n.GATE_WAIT, n.WAIT_FOR_LOADS)


def step_window(path_or_trace, steps: tuple[int, int] | None = None, rank: int = 0) -> tuple[float, float]:
    """(start_s, end_s) of steps A..B inclusive of trainer `rank` (the recorded ones among them). Default: the
    `DEFAULT_STEPS` steps in the middle of its longest run of consecutive recorded steps (steady state, whole)."""
    procs = processes(path_or_trace)
    trainer = next((p for p in procs if p["role"] == TRAINER and p["rank"] == rank), procs[0] if procs else None)
    recorded = sorted((s for s in trainer["steps"] if s[0] is not None), key=lambda s: s[0]) if trainer else []
    if not recorded:
        times = [t for p in procs for sp in p["spans"] for t in sp[2:4]]
        if not times:
            raise ValueError("the trace has no spans")
        return min(times), max(times)
    if steps is None:
        runs, current = [], [recorded[0]]
        for previous, step in zip(recorded, recorded[1:], strict=False):
            if step[0] == previous[0] + 1:
                current.append(step)
            else:
                runs.append(current)
                current = [step]
        runs.append(current)
        longest = max(runs, key=len)  # the first of equal length: the full-recording steps at the run's start
        middle = max(0, (len(longest) - DEFAULT_STEPS) // 2)
        chosen = longest[middle : middle + DEFAULT_STEPS]
    else:
        first, last = steps
        chosen = [s for s in recorded if first <= s[0] <= last]
        if not chosen:
            kept = f"{recorded[0][0]}..{recorded[-1][0]}"
            raise ValueError(f"no recorded step of trainer rank {rank} in {first}:{last} (recorded: {kept}, sampled)")
    return min(s[1] for s in chosen), max(s[2] for s in chosen)


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """The `--steps` text: "A:B" -> (A, B); "A" -> (A, A); None -> None."""
    if not text:
        return None
    first, _, last = text.partition(":")
    return int(first), int(last or first)


def _colours(categories: dict[str, str], plt) -> dict[str, tuple]:
    tab10, tab20 = plt.get_cmap("tab10").colors, plt.get_cmap("tab20").colors
    busy_palette = [c for i, c in enumerate(tab10) if i not in (3, 7)] + [tab20[i] for i in range(1, 20, 2)]
    wait_palette = [tab10[3], tab10[7], tab20[7], tab20[15]]
    colour = {}
    for order, palette, is_wait in ((BUSY_ORDER, busy_palette, False), (WAIT_ORDER, wait_palette, True)):
        others = sorted(name for name, cat in categories.items() if (cat == WAIT) == is_wait and name not in order)
        for i, name in enumerate([*order, *others]):
            colour[name] = palette[i % len(palette)]
    return colour


def _depths(spans: list[tuple]) -> list[int]:
    """Nesting depth of each span (sorted by start, longest first) within the spans that contain it."""
    depths, open_ends = [], []
    for _, _, start, end, _ in spans:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(end)
    return depths


def draw_gantt(path_or_trace, png: str, steps: tuple[int, int] | str | None = None, rank: int = 0) -> tuple:
    """Draw the window `steps` ("A:B", (A, B) or None for the default, `step_window`) into `png`; returns the
    window (start_s, end_s) on the trace's axis. The x axis is seconds from the window's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace = load_trace(path_or_trace)
    window = step_window(trace, parse_steps(steps) if isinstance(steps, str) else steps, rank)
    start, end = window
    procs = processes(trace)
    colour = _colours({sp[0]: sp[1] for p in procs for sp in p["spans"]}, plt)
    figure, axes = plt.subplots(figsize=(13, 1.0 + 0.75 * len(procs)))
    shown: dict[str, str] = {}
    for row, process in enumerate(procs):
        spans = sorted((sp for sp in process["spans"] if sp[3] > start and sp[2] < end), key=lambda s: (s[2], -s[3]))
        for span, depth in zip(spans, _depths(spans), strict=True):
            name, category, left, right, _ = span
            left, right = max(left, start), min(right, end)
            height = 0.7 * (0.75**depth)
            axes.broken_barh(
                [(left - start, right - left)], (row - height / 2, height), facecolors=colour[name],
                edgecolor="black" if category == WAIT else "none", linewidth=0.3, hatch="///" if category == WAIT else None,
            )  # fmt: skip
            shown[name] = category
        for name, at in process["instants"].items():
            if start <= at <= end:
                axes.plot([at - start] * 2, [row - 0.45, row + 0.45], color="black", linewidth=1)
                axes.annotate(name, (at - start, row + 0.45), fontsize=6, rotation=30)
    reference = next((p for p in procs if p["role"] == TRAINER and p["rank"] == rank), None)
    boundaries = [(step, left) for step, left, _, _ in (reference["steps"] if reference else [])
                  if step is not None and start <= left <= end]  # fmt: skip
    for step, left in boundaries:
        axes.axvline(left - start, color="grey", linestyle=":", linewidth=0.6)
        label = f"step {step}" if len(boundaries) <= 12 else f"{step}"
        axes.annotate(label, (left - start, len(procs) - 0.45), fontsize=6, color="grey")
    axes.set_yticks(range(len(procs)), [p["label"] for p in procs])
    axes.set_ylim(len(procs) - 0.4, -0.6)
    axes.set_xlim(0, end - start)
    axes.set_xlabel(f"seconds from {start:.3f} s (dotted: trainer rank {rank}'s steps)")
    legend = [
        Patch(facecolor=colour[n], hatch="///" if c == WAIT else None, label=n) for n, c in sorted(shown.items())
    ]
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return window
