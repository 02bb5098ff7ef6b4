"""Markdown for benchmarks/RESULTS.md: one renderer per benchmark, reading the benchmark's own JSON.

Every figure is computed here from the per-run records in the JSON (the runs, the repeats, the seeds), not copied from
a summary the benchmark wrote, so a summary that drifted from its runs cannot reach RESULTS.md. Conventions:

* a paired ratio is computed per pair (or repeat) from the two runs of that pair, then reported as
  median [min, max] over the pairs;
* `±` is always the standard error of the mean over the seeds or repeats named beside it;
* times are medians over the runs of one mode.

`benchmarks/run_all.py` holds the registry that maps each benchmark to its command, its JSON and its renderer here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence

# ------------------------------------------------------------------------------------------------ the section object


@dataclasses.dataclass
class Section:
    """One benchmark's loaded results, as a renderer sees them."""

    name: str
    files: list[str]  # absolute paths of the JSON files the figures come from
    data: list[dict]  # their contents, in the same order
    doc_dir: str  # the folder of the document being written: links are relative to it
    options: dict = dataclasses.field(default_factory=dict)  # the registry's per-benchmark renderer options

    @property
    def first(self) -> dict:
        return self.data[0]

    def link(self, path: str, text: str | None = None) -> str:
        """A markdown link to `path` (absolute) from the document; raises if the file does not exist."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"{self.name}: the results link to {path}, which does not exist")
        rel = os.path.relpath(path, self.doc_dir).replace(os.sep, "/")
        return f"[{text or os.path.basename(path)}]({rel})"

    def beside(self, json_path: str, filename: str) -> str:
        return os.path.join(os.path.dirname(json_path), filename)

    def pictures(self, names: Sequence[tuple[str, str]]) -> str:
        """Links to the pictures (file name beside the first JSON, caption) that exist; '' when none does."""
        links = []
        for filename, caption in names:
            path = self.beside(self.files[0], filename)
            if os.path.exists(path):
                links.append(self.link(path, caption))
        return ("Pictures: " + " · ".join(links)) if links else ""


Row = tuple[str, str]  # (what was measured, the figure) for the results table

# ------------------------------------------------------------------------------------------------ formatting helpers


def paired(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt_ratio(values: Sequence[float], unit: str = "pairs") -> str:
    """`1.86× [1.75, 1.96] over 3 pairs`; one value: `1.86× (1 pair)`."""
    if not values:
        return "–"
    s = paired(values)
    if s["n"] == 1:
        return f"{s['median']:.2f}× (1 {unit.rstrip('s')})"
    return f"{s['median']:.2f}× [{s['min']:.2f}, {s['max']:.2f}] over {s['n']} {unit}"


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); NaN error for one value."""
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], math.nan
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


# Student's t, two-sided 95%: the quantile 0.975 by degrees of freedom (1-30); past 30, the normal's 1.96 is near.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def interval95(values: Sequence[float]) -> tuple[float, float]:
    """The 95% confidence interval of the mean, mean ± t(0.975, n - 1) · standard error; NaNs for fewer than 2."""
    mean, se = mean_se(values)
    n = len([v for v in values if v is not None])
    if n < 2:
        return math.nan, math.nan
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return mean - t * se, mean + t * se


def fmt_interval95(values: Sequence[float]) -> str:
    """`, 95% interval [low, high]` (signed), or nothing where there is no interval (fewer than 2 values)."""
    low, high = interval95(values)
    return "" if math.isnan(low) else f", 95% interval [{low:+.3f}, {high:+.3f}]"


def fmt_mean_se(values: Sequence[float], digits: int = 3, signed: bool = False) -> str:
    mean, se = mean_se(values)
    if math.isnan(mean):
        return "–"
    sign = "+" if signed else ""
    if math.isnan(se):
        return f"{mean:{sign}.{digits}f}"
    return f"{mean:{sign}.{digits}f} ± {se:.{digits}f}"


def se_note(n: int, unit: str) -> str:
    """What a `±` next to it means: `mean ± standard error over 3 seeds`; one value has no error estimate."""
    return f"mean ± standard error over {n} {unit}s" if n > 1 else f"one {unit}, no error estimate"


def num(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def quarter_means(curve: Sequence[float]) -> tuple[float, float]:
    """Mean of the first and of the last quarter of a per-step curve (at least one step each)."""
    q = max(1, len(curve) // 4)
    return statistics.mean(curve[:q]), statistics.mean(curve[-q:])


# ------------------------------------------------------------------------------------------------ main job

REGIME_TEXT = {
    "same_cores": (
        "Both runs are started with `python recipes/qwen_math.py` and no thread settings (OMP_NUM_THREADS and "
        "MKL_NUM_THREADS removed): the synchronous run's torch uses every core, and the asynchronous run splits the "
        "same cores between its trainer and its generation process."
    ),
    "accelerate_launch": (
        "Both runs are started with `accelerate launch recipes/qwen_math.py` and OMP_NUM_THREADS unset. On a machine "
        "without a GPU, accelerate's launcher then exports OMP_NUM_THREADS=1 (accelerate/commands/launch.py), so the "
        "synchronous run trains and generates on one core while the asynchronous run's generation process computes "
        "on a second one: this ratio includes that extra core. It is what a user of `accelerate launch` on a CPU "
        "machine sees, not a same-cores comparison."
    ),
    "omp_num_threads_2": (
        "Both runs are started with `OMP_NUM_THREADS=2 python recipes/qwen_math.py` (a user who set a thread count, "
        "2 on the 2-core machine): the synchronous run's torch uses 2 threads, and the asynchronous run's trainer "
        "and generation process share that budget of 2."
    ),
    "two_processes": (
        "Both runs are started with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 "
        "recipes/qwen_math.py` and OMP_NUM_THREADS unset: two CPU ranks, to which the launcher exports "
        "OMP_NUM_THREADS=1. The synchronous run's two ranks take the two cores; the asynchronous run's two trainers and "
        "their two generation processes share the same two cores."
    ),
}


def main_job_regime(data: dict) -> str:
    """The regime a main-job file was measured in (files from before `--regime` existed: from their command)."""
    if "regime" in data:
        return data["regime"]
    return "accelerate_launch" if data.get("command", "").startswith("accelerate launch") else "same_cores"


def complete_pairs(data: dict, side_key: str, sides: tuple[str, str]) -> list[dict]:
    """{side: run} per pair that has a run of both `sides` (each run's `side_key`), in pair order."""
    by_pair: dict = {}
    for run in data["runs"]:
        by_pair.setdefault(run["pair"], {})[run[side_key]] = run
    return [p for _, p in sorted(by_pair.items()) if set(sides) <= set(p)]


def main_job_pairs(data: dict) -> list[dict]:
    """{'async': run, 'sync': run} per complete pair, in pair order."""
    return complete_pairs(data, "mode", ("async", "sync"))


def main_job_speedups(data: dict) -> list[float]:
    """Training seconds, sync / async, per pair (> 1: asynchronous generation is faster)."""
    return [p["sync"]["train_seconds"] / p["async"]["train_seconds"] for p in main_job_pairs(data)]


def render_main_job(section: Section) -> str:
    data = section.first
    regime = main_job_regime(data)
    pairs = main_job_pairs(data)
    out = [
        f"Command: `{data.get('command', '?')}`, one pair = one run of each, order alternating from pair to pair.",
        "",
    ]
    out.append(f"Cores: {REGIME_TEXT[regime]}")
    seen = data.get("environment", {}).get("seen_by_the_recipe")
    if seen:
        out.append(
            f"What the recipe saw (a probe started the same way): OMP_NUM_THREADS={seen.get('OMP_NUM_THREADS')}, "
            f"torch threads {seen.get('torch_num_threads')}, usable cores {seen.get('usable_cores')}."
        )
    else:
        out.append("This file does not record the thread settings the recipe saw.")
    rows = []
    for index, pair in enumerate(pairs):
        for mode in sorted(pair, key=lambda m: pair[m].get("position", 0)):
            r = pair[mode]
            rows.append([index, mode, r.get("seed") if r.get("seed") is not None else "default",
                         num(r["train_seconds"], ".1f"), num(r["wall_seconds"], ".1f"),
                         num(r.get("reward_first_quarter")), num(r.get("reward_last_quarter")),
                         num(r.get("reward_gain"), "+.3f"), num(r.get("accuracy_before")),
                         num(r.get("accuracy_after"))])  # fmt: skip
    out += ["", table(["pair", "mode", "seed", "training s", "wall s", "reward, first quarter", "last quarter",
                       "gain", "held-out accuracy before", "after"], rows), ""]  # fmt: skip
    train = main_job_speedups(data)
    wall = [p["sync"]["wall_seconds"] / p["async"]["wall_seconds"] for p in pairs]
    med = {m: statistics.median(p[m]["train_seconds"] for p in pairs) for m in ("async", "sync")}
    out.append(
        f"- Training time (`trainer.train()`), synchronous / asynchronous, paired: **{fmt_ratio(train)}**; "
        f"medians {med['async']:.1f} s asynchronous, {med['sync']:.1f} s synchronous."
    )
    out.append(f"- Whole command (wall), paired: {fmt_ratio(wall)}.")
    limit = limit_text(data.get("summary", {}).get("limit_ideal_overlap_ratio"))
    if limit:
        out.append(f"- {limit}")
    bound = core_bound(section)
    if bound:
        reference, cores, one_thread_s, ratio = bound
        out.append(
            f"- What {cores} cores allow at most: the synchronous run on one thread takes {one_thread_s:.1f} s "
            f"(median training time, {section.link(reference)}); {cores} cores, each at one thread's speed, do that "
            f"work in no less than {one_thread_s / cores:.1f} s, so asynchronous generation can be at most "
            f"{med['sync']:.1f} / {one_thread_s / cores:.1f} = **{ratio:.2f}×** faster than this synchronous run, "
            "however it overlaps the stages (both modes do the same work, and per core one thread is never slower "
            "than several threads splitting it)."
        )
    gains = {m: [p[m]["reward_gain"] for p in pairs if p[m].get("reward_gain") is not None] for m in ("async", "sync")}
    if gains["async"] and gains["sync"]:
        out.append(
            f"- Reward gain (mean reward of the last quarter of steps minus the first), median: asynchronous "
            f"{statistics.median(gains['async']):+.3f}, synchronous {statistics.median(gains['sync']):+.3f}."
        )
    acc = {
        m: [p[m]["accuracy_after"] for p in pairs if p[m].get("accuracy_after") is not None] for m in ("async", "sync")
    }
    if acc["async"] and acc["sync"]:
        samples = pairs[0]["async"].get("eval_samples")
        before = statistics.median(p["async"]["accuracy_before"] for p in pairs)
        out.append(
            f"- Held-out greedy accuracy ({samples} problems), median: {before:.3f} before training; after, "
            f"asynchronous {statistics.median(acc['async']):.3f}, synchronous {statistics.median(acc['sync']):.3f}."
        )
    pictures = section.pictures(
        [
            (
                os.path.splitext(os.path.basename(section.files[0]))[0] + ".png",
                "training time and reward gain per run",
            ),
            ("main_job_reward_accuracy.png", "the first asynchronous run's reward and held-out accuracy"),
        ]
    )
    return "\n".join(out + (["", pictures] if pictures else []))


def core_bound(section: Section) -> tuple[str, int, float, float] | None:
    """The most any overlap can give on this machine's cores, for a main-job file whose synchronous runs use every
    core: (the one-thread reference file, cores, its synchronous median training seconds, the bound).

    Overlap cannot create compute: both modes do the same work, and on C cores it takes at least W1 / C seconds,
    where W1 is its time on one thread (a core running one thread is at least as fast per core as C threads sharing
    the work). So the synchronous / asynchronous ratio is at most S / (W1 / C), S this file's synchronous median.
    W1 comes from the file named by the renderer option `one_thread_reference` (beside this one): the main job under
    `accelerate launch`, whose launcher gives the synchronous run one thread. None without that option or file."""
    name = section.options.get("one_thread_reference")
    if not name:
        return None
    reference = section.beside(section.files[0], name)
    if not os.path.exists(reference):
        return None
    with open(reference) as f:
        one_thread = json.load(f)
    seen = one_thread.get("environment", {}).get("seen_by_the_recipe", {})
    cores = seen.get("usable_cores")
    if seen.get("torch_num_threads") != 1 or not cores or cores < 2:
        return None  # the reference's synchronous run did not compute on one thread: no bound from it
    here, there = (d.get("run_all", {}).get("machine", {}) for d in (section.first, one_thread))
    if here.get("cpu") != there.get("cpu") or here.get("cores") != cores or there.get("cores") != cores:
        return None  # measured on another kind of machine (or not recorded): its one-thread time says nothing here
    one_thread_s = statistics.median(p["sync"]["train_seconds"] for p in main_job_pairs(one_thread))
    sync_s = statistics.median(p["sync"]["train_seconds"] for p in main_job_pairs(section.first))
    return reference, cores, one_thread_s, sync_s / (one_thread_s / cores)


def limit_text(limit: dict | None) -> str | None:
    """The limit of a speed row, from synchronous runs' timelines (`trl_async.timeline.sync_limit`)."""
    if not limit:
        return None
    values = limit.get("values", [])
    spread = f" [{limit['min']:.2f}, {limit['max']:.2f}] over {len(values)} runs" if len(values) > 1 else ""
    return (
        f"The limit, from the synchronous runs' timelines: (generation + training) / max(generation, training) = "
        f"{limit['median']:.2f}×{spread}, what overlapping the two stages could give at most if each kept the "
        "cores it has in the synchronous run."
    )


def summary_main_job(section: Section) -> list[Row]:
    data = section.first
    pairs = main_job_pairs(data)
    med = {m: statistics.median(p[m]["train_seconds"] for p in pairs) for m in ("async", "sync")}
    what = {
        "same_cores": "The main job (`python recipes/qwen_math.py`, tiny model), asynchronous vs synchronous "
        "generation, both on every core: training time",
        "accelerate_launch": "The same under `accelerate launch` (its launcher gives the synchronous run one core "
        "on a CPU-only machine)",
        "omp_num_threads_2": "The same with `OMP_NUM_THREADS=2` set by the user (both runs share a budget of 2 "
        "threads)",
        "two_processes": "The same on two CPU ranks (`accelerate launch --multi_gpu --num_processes 2`, both runs on "
        "the same two cores)",
    }[main_job_regime(data)]
    limit = data.get("summary", {}).get("limit_ideal_overlap_ratio")
    limit = f"; limit {limit['median']:.2f}×" if limit else ""
    bound = core_bound(section)
    if bound:
        limit += f", {bound[1]} cores allow at most {bound[3]:.2f}×"
    return [(what, f"**{fmt_ratio(main_job_speedups(data))}** ({med['async']:.0f} s vs {med['sync']:.0f} s{limit})")]


def seed_pairs(section: Section) -> list[dict]:
    """One {'seed', 'regime', 'async', 'sync'} per seeded pair, over every file of the section."""
    out = []
    for data in section.data:
        for pair in main_job_pairs(data):
            out.append({"seed": pair["async"].get("seed"), "regime": main_job_regime(data), **pair})
    return sorted(out, key=lambda p: (p["seed"] is None, p["seed"] or 0))


def render_main_job_seeds(section: Section) -> str:
    pairs = seed_pairs(section)
    regimes = sorted({p["regime"] for p in pairs})
    out = [
        "One pair (asynchronous, synchronous) of the default job per seed (`--seed S`): how far the learning "
        "figures move with the seed alone, to read the asynchronous-minus-synchronous differences against. "
        f"Launched as: {', '.join(f'`{r}`' for r in regimes)} (see the main-job sections for what that means for "
        "the cores; these figures are about learning, not time).",
        "",
    ]
    rows = []
    for p in pairs:
        a, s = p["async"], p["sync"]
        rows.append([p["seed"], num(a["reward_gain"], "+.3f"), num(s["reward_gain"], "+.3f"),
                     num(a["reward_gain"] - s["reward_gain"], "+.3f"), num(a["accuracy_after"]),
                     num(s["accuracy_after"]), num(a["accuracy_after"] - s["accuracy_after"], "+.3f")])  # fmt: skip
    out.append(table(["seed", "reward gain, async", "sync", "async − sync", "held-out accuracy after, async", "sync",
                      "async − sync"], rows))  # fmt: skip
    acc_diff = [p["async"]["accuracy_after"] - p["sync"]["accuracy_after"] for p in pairs]
    gain_diff = [p["async"]["reward_gain"] - p["sync"]["reward_gain"] for p in pairs]
    sync_acc = [p["sync"]["accuracy_after"] for p in pairs]
    sync_gain = [p["sync"]["reward_gain"] for p in pairs]
    ratios = [p["sync"]["train_seconds"] / p["async"]["train_seconds"] for p in pairs]
    out += [
        "",
        f"- Held-out accuracy after training, async − sync: {fmt_mean_se(acc_diff, signed=True)} "
        f"({se_note(len(pairs), 'seed')}){fmt_interval95(acc_diff)}; async higher on {sum(d > 0 for d in acc_diff)} of {len(pairs)}, lower on "
        f"{sum(d < 0 for d in acc_diff)}. Synchronous runs alone range from {min(sync_acc):.3f} to {max(sync_acc):.3f}.",
        f"- Reward gain, async − sync: {fmt_mean_se(gain_diff, signed=True)} ({se_note(len(pairs), 'seed')}); "
        f"the synchronous gain alone ranges from {min(sync_gain):+.3f} to {max(sync_gain):+.3f}.",
        f"- Training time, sync / async, paired by seed: median {statistics.median(ratios):.2f}× "
        f"[{min(ratios):.2f}, {max(ratios):.2f}] over {len(ratios)} pairs (the main-job sections measure time; this "
        "is the same job, one pair per seed).",
    ]
    links = [
        section.link(os.path.splitext(f)[0] + ".png", f"runs of {os.path.basename(f)}")
        for f in section.files
        if os.path.exists(os.path.splitext(f)[0] + ".png")
    ]
    links += [  # bench_main_job.py --seeds: learning at equal wall time
        section.link(os.path.splitext(f)[0] + "_equal_time.png", "reward and held-out accuracy against wall-clock "
                     "time, seed means (the accuracy reached at equal wall time)")
        for f in section.files
        if os.path.exists(os.path.splitext(f)[0] + "_equal_time.png")
    ]  # fmt: skip
    if links:
        out += ["", "Pictures: " + " · ".join(links)]
    return "\n".join(out)


def summary_main_job_seeds(section: Section) -> list[Row]:
    pairs = seed_pairs(section)
    acc_diff = [p["async"]["accuracy_after"] - p["sync"]["accuracy_after"] for p in pairs]
    regimes = ", ".join(sorted({p["regime"] for p in pairs}))
    return [
        (
            "The main job's held-out greedy accuracy after training, asynchronous − synchronous, one pair per seed "
            f"({regimes})",
            f"{fmt_mean_se(acc_diff, signed=True)} ({se_note(len(pairs), 'seed')}{fmt_interval95(acc_diff)})",
        )
    ]


# ------------------------------------------------------------------------------------------------ docs-style script

DOCS_STYLE_METRICS = (
    ("async/trainer_lent_cores_fraction", "trainer's layer passes on every core", ".2f"),
    ("async/generator_wait_s", "generator waiting, s", ".2f"),
    ("async/trainer_wait_s", "trainer waiting, s", ".2f"),
    ("async/generate_s", "generation s per batch", ".3f"),
    ("async/staleness_mean", "staleness, mean", ".2f"),
    ("async/evicted", "rows evicted", ".0f"),
)


def docs_style_pairs(data: dict) -> list[dict]:
    return complete_pairs(data, "trainer", ("trl", "async"))


def docs_style_speedups(data: dict) -> list[float]:
    return [p["trl"]["train_s"] / p["async"]["train_s"] for p in docs_style_pairs(data)]


def render_docs_style(section: Section) -> str:
    data = section.first
    pairs = docs_style_pairs(data)
    steps = data.get("summary", {}).get("steps")
    out = [
        "`benchmarks/docs_style_grpo.py`: a GRPO script written the way TRL's documentation writes one (a plain "
        f"`GRPOConfig` with TRL's defaults, 32 rows a step, {steps} steps, a text reward, the bundled tiny model), "
        "run with `GRPOTrainer` and, with only the class name swapped, with `AsyncGRPOTrainer`, in alternating "
        "fresh processes. Cores: both started with `python`, OMP_NUM_THREADS and MKL_NUM_THREADS removed, so both "
        "get every core.",
        "",
    ]
    rows = [[i, num(p["trl"]["train_s"], ".1f"), num(p["async"]["train_s"], ".1f"),
             num(p["trl"]["train_s"] / p["async"]["train_s"], ".2f")] for i, p in enumerate(pairs)]  # fmt: skip
    out += [table(["pair", "GRPOTrainer s", "AsyncGRPOTrainer s", "ratio"], rows), ""]
    out.append(
        f"- `trainer.train()` seconds, GRPOTrainer / AsyncGRPOTrainer, paired: **{fmt_ratio(docs_style_speedups(data))}**"
        f"; medians {statistics.median(p['trl']['train_s'] for p in pairs):.1f} s and "
        f"{statistics.median(p['async']['train_s'] for p in pairs):.1f} s."
    )
    rewards = {t: [quarter_means(p[t]["rewards"])[1] for p in pairs if p[t].get("rewards")] for t in ("trl", "async")}
    if rewards["trl"] and rewards["async"]:
        out.append(
            f"- Mean logged reward of the last quarter of logs: GRPOTrainer {fmt_mean_se(rewards['trl'])}, "
            f"AsyncGRPOTrainer {fmt_mean_se(rewards['async'])} ({se_note(len(pairs), 'run')})."
        )
    limit = data.get("summary", {}).get("limit")
    if limit:
        out.append(
            f"- The limit, from a synchronous run's timeline (`AsyncGRPOTrainer` with `async_generation=False`): "
            f"(generation + training) / max(generation, training) = {limit['ideal_overlap_ratio']:.2f}×"
            + (f"; the run kept {limit['core_busy_fraction']:.0%} of its core-seconds busy" if "core_busy_fraction"
               in limit else "") + "."
        )  # fmt: skip
    gaps = data.get("summary", {}).get("held_out_accuracy_async_minus_sync_per_pair")
    if gaps:
        out.append(
            f"- Held-out greedy accuracy after training (200 problems), asynchronous − synchronous per pair: "
            f"{', '.join(f'{g:+.3f}' for g in gaps)} (mean {statistics.mean(gaps):+.3f})."
        )
    logs = [p["async"].get("async_last_log") for p in pairs if p["async"].get("async_last_log")]
    if logs:
        out += [
            "",
            "The asynchronous runs' `async/*` metrics over their last logging window (TRL's default "
            "`logging_steps`), one row per run:",
            "",
        ]
        present = [m for m in DOCS_STYLE_METRICS if any(m[0] in log for log in logs)]
        rows = [[i] + [num(log.get(key), spec) for key, _, spec in present] for i, log in enumerate(logs)]
        out.append(table(["run"] + [label for _, label, _ in present], rows))
    return "\n".join(out)


def summary_docs_style(section: Section) -> list[Row]:
    return [
        (
            f"A TRL-docs-style GRPO script (plain `GRPOConfig`, {section.first.get('summary', {}).get('steps')} "
            "steps), `GRPOTrainer` vs `AsyncGRPOTrainer`, "
            "both on every core: training time",
            f"**{fmt_ratio(docs_style_speedups(section.first))}**"
            + (
                f" (limit {limit['ideal_overlap_ratio']:.2f}×)"
                if (limit := section.first.get("summary", {}).get("limit"))
                else ""
            ),
        )
    ]


# ------------------------------------------------------------------------------------------------ docs-style seeds


def docs_style_accuracy_differences(data: dict) -> list[float]:
    """Held-out greedy accuracy after training, `AsyncGRPOTrainer` − `GRPOTrainer`, per pair (one seed each)."""
    return [p["async"]["held_out_accuracy"] - p["trl"]["held_out_accuracy"] for p in docs_style_pairs(data)]


def docs_style_seeds_lines(data: dict) -> list[str]:
    """The seeds study's figures as markdown bullets (also what `bench_docs_style.py --seeds` prints)."""
    pairs = docs_style_pairs(data)
    diffs = docs_style_accuracy_differences(data)
    trl = [p["trl"]["held_out_accuracy"] for p in pairs]
    ratios = docs_style_speedups(data)
    return [
        f"- Held-out greedy accuracy after training, `AsyncGRPOTrainer` − `GRPOTrainer`, paired by seed: "
        f"**{fmt_mean_se(diffs, signed=True)}** ({se_note(len(diffs), 'seed')}){fmt_interval95(diffs)}; "
        f"`AsyncGRPOTrainer` higher on {sum(d > 0 for d in diffs)} of {len(diffs)} seeds, lower on "
        f"{sum(d < 0 for d in diffs)}. `GRPOTrainer` alone ranges from {min(trl):.3f} to {max(trl):.3f}.",
        f"- `trainer.train()` seconds, `GRPOTrainer` / `AsyncGRPOTrainer`, paired by seed: {fmt_ratio(ratios)}.",
    ]


def docs_style_seeds_text(data: dict) -> str:
    return "\n".join(docs_style_seeds_lines(data))


def render_docs_style_seeds(section: Section) -> str:
    data = section.first
    steps = data.get("summary", {}).get("steps")
    out = [
        f"`benchmarks/docs_style_grpo.py` ({steps} steps; see the docs-style section) with `GRPOTrainer` and with "
        "`AsyncGRPOTrainer` (the class swapped, a plain `GRPOConfig`: TRL's loss and importance correction), one pair "
        "per seed, the seed passed to `GRPOConfig(seed=...)` in both arms, order alternating from seed to seed, both "
        "on every core. Held-out greedy accuracy after training on 200 arithmetic problems never trained on.",
        "",
    ]
    rows = [[p["trl"].get("seed"), num(p["trl"]["held_out_accuracy"]), num(p["async"]["held_out_accuracy"]),
             num(p["async"]["held_out_accuracy"] - p["trl"]["held_out_accuracy"], "+.3f"),
             num(p["trl"]["train_s"], ".1f"), num(p["async"]["train_s"], ".1f")]
            for p in docs_style_pairs(data)]  # fmt: skip
    out.append(table(["seed", "held-out accuracy, GRPOTrainer", "AsyncGRPOTrainer", "async − TRL",
                      "GRPOTrainer s", "AsyncGRPOTrainer s"], rows))  # fmt: skip
    return "\n".join(out + ["", *docs_style_seeds_lines(data)])


def summary_docs_style_seeds(section: Section) -> list[Row]:
    diffs = docs_style_accuracy_differences(section.first)
    steps = section.first.get("summary", {}).get("steps")
    return [
        (
            f"A TRL-docs-style GRPO script (plain `GRPOConfig`, {steps} steps): held-out greedy accuracy after "
            "training, `AsyncGRPOTrainer` − `GRPOTrainer`, one pair per seed",
            f"{fmt_mean_se(diffs, signed=True)} ({se_note(len(diffs), 'seed')}{fmt_interval95(diffs)})",
        )
    ]


# ------------------------------------------------------------------------------------------------ bench_tools


def tools_pairs(data: dict) -> list[dict]:
    return complete_pairs(data, "arm", ("sync", "async"))


def tools_speedups(data: dict) -> list[float]:
    """Training seconds, sync / async, per pair: computed from the runs (never copied from a summary)."""
    return [p["sync"]["train_s"] / p["async"]["train_s"] for p in tools_pairs(data)]


def render_tools(section: Section) -> str:
    data = section.first
    pairs = tools_pairs(data)
    summary = data.get("summary", {})
    latency = summary.get("tool_latency_ms")
    out = [
        "`benchmarks/bench_tools.py`: the docs-style job with a tool (a plain `GRPOConfig` with TRL's defaults, 32 "
        f"rows a step, {summary.get('steps')} steps, the bundled tools model, `tools=[multiply]` after a sleep of "
        f"{num(latency, '.0f')} ms per call), run with `GRPOTrainer` (TRL's synchronous tool loop) and with "
        "`AsyncGRPOTrainer` (tools in the generation process), in alternating fresh processes, both on every core.",
        "",
    ]
    rows = [[i, num(p["sync"]["train_s"], ".1f"), num(p["async"]["train_s"], ".1f"),
             num(p["sync"]["train_s"] / p["async"]["train_s"], ".2f"),
             num(p["sync"]["accuracy_after"]["accuracy"]), num(p["async"]["accuracy_after"]["accuracy"])]
            for i, p in enumerate(pairs)]  # fmt: skip
    header = ["pair", "GRPOTrainer s", "AsyncGRPOTrainer s", "ratio", "accuracy after (sync)", "(async)"]
    out += [table(header, rows), ""]
    out.append(
        f"- `trainer.train()` seconds, GRPOTrainer / AsyncGRPOTrainer, paired: **{fmt_ratio(tools_speedups(data))}**."
    )
    before = summary.get("held_out_accuracy_before") or {}
    if before:
        out.append(
            f"- Held-out greedy accuracy with the tool executed ({before.get('n')} problems): "
            f"{num(before.get('accuracy'))} before training."
        )
    return "\n".join(out)


def summary_tools(section: Section) -> list[Row]:
    latency = section.first.get("summary", {}).get("tool_latency_ms")
    return [
        (
            f"A tool of {num(latency, '.0f')} ms per call (`tools=`), docs-style job: `GRPOTrainer` vs "
            "`AsyncGRPOTrainer`, training time",
            f"**{fmt_ratio(tools_speedups(section.first))}**",
        )
    ]


# ------------------------------------------------------------------------------------------------ bench_async

ASYNC_LABELS = {
    "trl": "TRL `GRPOTrainer` (the baseline)",
    "async-dapo": "async, `dapo` (TRL's default loss), default staleness",
    "async-m2po": "async, `m2po`",
    "async-dapo-S2": "async, `dapo`, `max_staleness=2`",
    "async-vllm": "async, `dapo`, vLLM backend",
    "async-dapo-inflight": "async, `dapo`, default staleness, in-flight weight updates",
    "async-dapo-S2-inflight": "async, `dapo`, `max_staleness=2`, in-flight weight updates",
}
REGIME_LABELS = {
    "free": "free-length completions",
    "forced64": "completions forced to 64 tokens",
    "forced256": "completions forced to 256 tokens",
}
# In-flight contender -> the gate-only contender at the same max_staleness (issue 24's comparison).
INFLIGHT_PAIRS = {"async-dapo-inflight": "async-dapo", "async-dapo-S2-inflight": "async-dapo-S2"}


def async_regime(section: Section) -> tuple[str, dict]:
    regime = section.options.get("regime") or next(iter(section.first["regimes"]))
    return regime, section.first["regimes"][regime]


def async_speedups(entry: dict, name: str) -> list[float]:
    """TRL's train seconds / the contender's, per repeat (end to end, generation process start-up included)."""
    return [b["train_s"] / c["train_s"] for b, c in zip(entry["runs"]["trl"], entry["runs"][name], strict=True)]


def steady_window(run: dict, warmup: int = 5) -> tuple[int, float]:
    """The steps after the warm-up (bench_async's: min(5, steps // 2)) and their wall seconds."""
    ends = run["step_end"]
    warmup = min(warmup, len(ends) // 2)
    return warmup, ends[-1] - ends[warmup - 1]


def steady_rows_per_s(run: dict) -> float:
    warmup, seconds = steady_window(run)
    return (len(run["step_end"]) - warmup) * run["rows_per_step"] / seconds


def wait_share(run: dict, key: str) -> float:
    """Seconds one process waited for the other after the warm-up, as a share of that stretch's wall time."""
    warmup, seconds = steady_window(run)
    return sum(run.get(key, [])[warmup:]) / seconds


def render_async(section: Section) -> str:
    data = section.first
    regime, entry = async_regime(section)
    runs = entry["runs"]
    repeats = len(runs["trl"])
    has_accuracy = all(r.get("held_out_accuracy") is not None for rs in runs.values() for r in rs)
    out = [
        f"The bundled tiny model on generated arithmetic, 4 prompts × 8 completions a step, {data.get('steps')} steps, "
        f"{REGIME_LABELS.get(regime, regime)}, every contender at TRL's default configuration, each run a fresh "
        f"process, contenders interleaved within each repeat ({repeats} repeats). Cores: every run started with `python`, "
        "OMP_NUM_THREADS and MKL_NUM_THREADS removed, so TRL's trainer and the asynchronous trainer get the same "
        "cores. Ratios: TRL's `trainer.train()` seconds / the contender's in the same repeat, median [min, max]; "
        "steady state: rows per second after step 5, the same way.",
        "",
    ]
    rows = []
    for name, rs in runs.items():
        quarter = [quarter_means(r["reward"])[1] for r in rs]
        evicted = sum(r.get("evicted_rows", 0) for r in rs)
        length = statistics.mean(r["mean_length"] for r in rs)
        if name == "trl":
            e2e = steady = "1 (baseline)"
            waits = "–"
        else:
            trainer = statistics.median(wait_share(r, "trainer_wait_s") for r in rs)
            generator = statistics.median(wait_share(r, "generator_wait_s") for r in rs)
            waits = f"{trainer:.0%} / {generator:.0%}"
            e2e = fmt_ratio(async_speedups(entry, name), "repeats")
            steady = fmt_ratio(
                [steady_rows_per_s(c) / steady_rows_per_s(b) for b, c in zip(runs["trl"], rs, strict=True)], "repeats"
            )
        row = [ASYNC_LABELS.get(name, name), num(statistics.median(r["train_s"] for r in rs), ".1f"), e2e,
               steady, waits, int(evicted), num(length, ".1f"), fmt_mean_se(quarter)]  # fmt: skip
        if has_accuracy:
            row.append(fmt_mean_se([r["held_out_accuracy"] for r in rs]))
        rows.append(row)
    header = ["contender", "train s (median)", "end to end vs TRL", "steady state vs TRL",
              "waiting after step 5: trainer / generator (median share)", "rows evicted",
              "mean completion tokens", f"reward, last quarter (± s.e. over {repeats})"]  # fmt: skip
    if has_accuracy:
        header.append(f"held-out accuracy, 500 problems (± s.e. over {repeats})")
    out.append(table(header, rows))
    inflight = render_inflight_against_gate(entry, repeats)
    if inflight:
        out += ["", inflight]
    probe = entry.get("probe")
    if probe:
        g, t = probe["generate_s"], probe["train_s"]
        out += [
            "",
            f"On one thread, one generation batch takes {g:.3f} s and one training step {t:.3f} s (a plain "
            f"`generate` and forward + backward + AdamW): two stages that overlap perfectly would take at most "
            f"(g + t) / max(g, t) = {(g + t) / max(g, t):.2f}× less time than running them one after the other.",
        ]
    json_stem = os.path.splitext(os.path.basename(section.files[0]))[0]
    candidates = [(f"{json_stem}_reward_vs_time_{regime}.png", "reward against wall-clock time")]
    candidates += [(name, "reward against wall-clock time") for name in section.options.get("pictures", ())]
    pictures = section.pictures(candidates)
    return "\n".join(out + (["", pictures] if pictures else []))


def inflight_ratios(entry: dict, name: str) -> tuple[list[float], list[float]]:
    """Gate-only seconds / in-flight seconds per repeat, end to end and steady state (> 1: in-flight is faster)."""
    gate, inflight = entry["runs"][INFLIGHT_PAIRS[name]], entry["runs"][name]
    e2e = [g["train_s"] / f["train_s"] for g, f in zip(gate, inflight, strict=True)]
    steady = [steady_rows_per_s(f) / steady_rows_per_s(g) for g, f in zip(gate, inflight, strict=True)]
    return e2e, steady


def render_inflight_against_gate(entry: dict, repeats: int) -> str:
    """Issue 24's comparison: each in-flight contender against the gate-only engine at the same max_staleness."""
    rows = []
    for name, gate in INFLIGHT_PAIRS.items():
        if name not in entry["runs"] or gate not in entry["runs"]:
            continue
        e2e, steady = inflight_ratios(entry, name)
        pairs = list(zip(entry["runs"][gate], entry["runs"][name], strict=True))
        accuracy = "–"
        if all(g.get("held_out_accuracy") is not None and f.get("held_out_accuracy") is not None for g, f in pairs):
            accuracy = fmt_mean_se([f["held_out_accuracy"] - g["held_out_accuracy"] for g, f in pairs], signed=True)
        ages = [f["token_age_mean"] for _, f in pairs if f.get("token_age_mean") is not None]
        rows.append([ASYNC_LABELS.get(name, name), fmt_ratio(e2e, "repeats"), fmt_ratio(steady, "repeats"), accuracy,
                     num(statistics.median(ages), ".2f") if ages else "–"])  # fmt: skip
    if not rows:
        return ""
    intro = (
        "In-flight weight updates against the gate-only engine at the same `max_staleness` (same repeat, paired): "
        "gate-only seconds / in-flight seconds (> 1: in-flight is faster), and the held-out accuracy difference "
        f"in-flight − gate-only (± s.e. over {repeats} repeats)."
    )
    header = ["in-flight contender", "end to end vs gate-only", "steady state vs gate-only",
              "held-out accuracy, in-flight − gate-only", "mean token age (optimizer steps, median of runs)"]  # fmt: skip
    return "\n".join([intro, "", table(header, rows)])


def summary_async(section: Section) -> list[Row]:
    regime, entry = async_regime(section)
    short = {"async-dapo": "`dapo`", "async-m2po": "`m2po`", "async-dapo-S2": "`dapo`, staleness 2",
             "async-vllm": "vLLM backend", "async-dapo-inflight": "`dapo` in-flight",
             "async-dapo-S2-inflight": "`dapo`, staleness 2, in-flight"}  # fmt: skip
    cells = [
        f"{short.get(n, n)} {fmt_ratio(async_speedups(entry, n), 'repeats')}" for n in entry["runs"] if n != "trl"
    ]
    steps = section.first.get("steps")
    what = (
        f"`AsyncGRPOTrainer` vs `GRPOTrainer` at TRL's defaults, tiny model, {steps} steps of 4 × 8 rows, "
        f"{REGIME_LABELS.get(regime, regime)}: end to end"
    )
    rows = [(what, "; ".join(cells))]
    inflight = [n for n in INFLIGHT_PAIRS if n in entry["runs"] and INFLIGHT_PAIRS[n] in entry["runs"]]
    if inflight:
        what = (
            "In-flight weight updates vs the gate-only engine at the same staleness, "
            f"{REGIME_LABELS.get(regime, regime)}: end to end"
        )
        cells = [f"staleness {2 if 'S2' in n else 1}: {fmt_ratio(inflight_ratios(entry, n)[0], 'repeats')}"
                 for n in inflight]  # fmt: skip
        rows.append((what, "; ".join(cells)))
    return rows


# ------------------------------------------------------------------------------------------------ components


def render_components(section: Section) -> str:
    data = section.first
    out = [
        "One generation batch and one training forward + backward of the docs-style batch (4 prompts × 8 "
        "completions, the tiny model, gradient checkpointing on), each on one thread, TRL's way and "
        "`AsyncGRPOTrainer`'s, alternating within each repeat; medians.",
        "",
    ]
    rows = []
    for regime in ("free", "forced64"):
        r = data.get(regime)
        if not r:
            continue
        m = r["medians_s"]
        rows.append([REGIME_LABELS[regime], num(r["completion_length_mean"], ".1f"),
                     num(m["generate_trl"] * 1e3, ".0f"), num(m["generate_ours"] * 1e3, ".0f"),
                     num(m["generate_trl"] / m["generate_ours"], ".2f") + "×", num(m["train_trl"] * 1e3, ".0f"),
                     num(m["train_ours"] * 1e3, ".0f"), num(m["train_trl"] / m["train_ours"], ".2f") + "×"])  # fmt: skip
    out.append(table(["batch", "completion tokens (mean)", "generation, TRL ms", "ours ms", "TRL / ours",
                      "training step, TRL ms", "ours ms", "TRL / ours"], rows))  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ losses

LOSS_LABELS = {"grpo": "TRL `grpo`", "m2po": "`m2po` (`paper`)", "m2po_all_tokens": "`all_tokens`",
               "m2po_authors_code": "`authors_code`", "m2po_ref": "reference-page rule"}  # fmt: skip


def render_losses(section: Section) -> str:
    data = section.first
    results = data["results"]
    contenders = [k for k in results[0]["paired_ratio_to_dapo"] if k != "dapo"]
    out = [
        f"Forward + backward of each loss on given log-prob tensors, {data.get('threads', 1)} thread(s) on "
        f"{data.get('device', 'cpu')}, τ = {data.get('tau')}; every contender in every repeat, in a fresh random "
        "order each repeat. Cells: the paired ratio to TRL's `dapo` (contender time / dapo time in the same repeat), "
        "median [min, max]. Regimes are calibrated on the `paper` rule: a nothing masked, b about 1%, c about 20%.",
        "",
    ]
    rows = []
    for r in results:
        ratios = r["paired_ratio_to_dapo"]
        cells = [f"{ratios[c]['median']:.2f} [{ratios[c]['min']:.2f}, {ratios[c]['max']:.2f}]" for c in contenders]
        masked = r.get("masked_fraction", {}).get("m2po")
        rows.append([f"{r['B']}×{r['L']}", f"{r['regime']} ({r.get('regime_name', '')})",
                     num(masked * 100 if masked is not None else None, ".1f") + "%", r.get("repeats"),
                     num(r["median_ms"]["dapo"], ".3f"), *cells])  # fmt: skip
    out.append(table(["B×L", "regime", "masked by `paper`", "repeats", "dapo ms (median)",
                      *[LOSS_LABELS.get(c, c) for c in contenders]], rows))  # fmt: skip
    out += [
        "",
        "TRL's `grpo` computes nearly what `dapo` computes: its ratio shows how far the pairing itself is from 1.",
    ]
    return "\n".join(out)


def summary_losses(section: Section) -> list[Row]:
    cells = []
    for r in section.first["results"]:
        if (r["B"], r["L"]) == (64, 256) and r["regime"] in "ab" and "m2po" in r["paired_ratio_to_dapo"]:
            s = r["paired_ratio_to_dapo"]["m2po"]
            masked = r.get("masked_fraction", {}).get("m2po", 0.0)
            cells.append(f"{s['median']:.2f}× with {masked:.0%} masked")
    return [
        ("M2PO loss (`paper` rule) forward + backward vs TRL's `dapo`, B=64, L=256, paired median", "; ".join(cells))
    ]


# ------------------------------------------------------------------------------------------------ rewards

HEADLINE_REWARD = "decode+regex (prepared) / tensor (prepared)"


def render_rewards(section: Section) -> str:
    data = section.first
    regimes = data["regimes"]
    head = regimes[0]
    host = data.get("host", {})
    out = [
        f"The real Qwen tokenizer, {host.get('threads', '?')} thread(s). Every timed call follows other work (a "
        "stand-in for generation) and scores a batch whose gold answers are new to the run; contenders side by "
        "side in each repeat, order rotating. `tensor (prepared)` is `MathAnswerReward` on the padded ids with the "
        "batch's answers prepared ahead (training's steady state); `decode+regex (prepared)` is `batch_decode` + "
        "`math_answer_text_reward` with its regexes compiled ahead.",
        "",
        f"B={head['batch']}, L={head['length']}, {head['new_golds_per_batch']} new answers per batch, "
        f"{head['repeats']} repeats, medians:",
        "",
    ]
    rows = [[name, num(head["cold_ms"][name]["median"], ".2f"),
             num(head.get("cold_cpu_ms", {}).get(name, {}).get("median"), ".2f")] for name in head["cold_ms"]]  # fmt: skip
    out += [table(["contender", "wall ms", "CPU ms"], rows), ""]
    rows = []
    for r in regimes:
        wall = r["paired_ratios"].get(HEADLINE_REWARD)
        cpu = r.get("paired_ratios_of_cpu_time", {}).get(HEADLINE_REWARD)
        fmt = lambda s: "–" if not s else f"{s['median']:.1f}× [{s['min']:.1f}, {s['max']:.1f}]"  # noqa: E731
        rows.append([f"B={r['batch']}, L={r['length']}, {r['new_golds_per_batch']} new answers per batch",
                     fmt(wall), fmt(cpu)])  # fmt: skip
    warm = head.get("warm_paired_ratios", {}).get(HEADLINE_REWARD + ", warm")
    if warm:
        rows.append([f"B={head['batch']}, L={head['length']}, the same call again right away (warm)",
                     f"{warm['median']:.1f}× [{warm['min']:.1f}, {warm['max']:.1f}]", "–"])  # fmt: skip
    out += ["Paired ratio decode+regex (prepared) / tensor (prepared), median [min, max]:", ""]
    out += [table(["batch", "wall time", "CPU time"], rows), ""]
    tiny = data.get("tiny_call_B8_L32")
    if tiny:
        out.append(
            f"- A tiny batch (B=8, L=32): cold − warm (paired) {tiny['cold_minus_warm_ms']['median']:.3f} ms after "
            f"other work, {tiny['after_sleep_minus_warm_ms']['median']:.3f} ms after a 10 ms sleep: a fixed cost per "
            "call after a gap, not the work."
        )
    per_gold = data.get("prepare_per_gold_composed_vs_general")
    if per_gold:
        pg, ratio = per_gold["ms_per_new_gold"], per_gold["general / composed"]
        out.append(
            f"- Preparing a new answer: {pg['composed (CPU)']['median']:.2f} ms of CPU time, against "
            f"{pg['general (CPU)']['median']:.2f} ms on the general path (every spelling tokenized with its marker); "
            f"paired {ratio['median']:.1f}× [{ratio['min']:.1f}, {ratio['max']:.1f}]."
        )
    column = data.get("prepare_dataset_column")
    if column:
        out.append(
            f"- Preparing a GSM8K-sized answer column ({column['rows']:,} rows, {column['unique_answers']:,} distinct "
            f"answers) at start-up: {column['seconds']:.1f} s, a {column['table_mib']:.0f} MiB table."
        )
    generation = data.get("tiny_model_generation_step_ms_B64_L256")
    if generation:
        out.append(
            f"- The bundled tiny model generates 64 × 256 tokens in {generation['median'] / 1e3:.1f} s here; the "
            f"prepared reward is {data['tensor_prepared_share_of_tiny_generation_step']:.4%} of that."
        )
    acc = data.get("accuracy")
    if acc:
        out += [
            "",
            f"Agreement with the labels of {acc['n']:,} labelled GSM8K-style completions (deterministic): "
            f"`MathAnswerReward` {acc['ours_rows_equal_to_label']:,}, `math_answer_text_reward` "
            f"{acc['text_regex_rows_equal_to_label']:,}, math-verify's `verify(parse(gold), parse(text))` "
            f"{acc['math_verify_accuracy']:.3f} of them. Per category (math-verify's share that agrees):",
            "",
        ]
        rows = [[cat, c["n"], num(c["ours_correct"] / c["n"], ".2f"), num(c["math_verify_correct"] / c["n"], ".2f")]
                for cat, c in acc["per_category"].items()]  # fmt: skip
        out.append(table(["category", "completions", "ours", "math-verify"], rows))
    gpu = data.get("gpu") or {}
    out += ["", "The no-host-sync check on a GPU " + ("ran." if gpu.get("ran") else "has not run (no GPU).")]
    return "\n".join(out)


def summary_rewards(section: Section) -> list[Row]:
    head = section.first["regimes"][0]
    cpu = head.get("paired_ratios_of_cpu_time", {}).get(HEADLINE_REWARD)
    wall = head["paired_ratios"][HEADLINE_REWARD]
    figure = f"{wall['median']:.1f}× by wall time"
    if cpu:
        figure = f"{cpu['median']:.1f}× by CPU time, " + figure
    return [
        (
            f"`MathAnswerReward` on token ids vs `batch_decode` + regex, B={head['batch']}, L={head['length']}, "
            "cold calls, paired median",
            figure,
        )
    ]


# ------------------------------------------------------------------------------------------------ importance modes


def render_is_modes(section: Section) -> str:
    data = section.first
    runs = data["runs"]
    modes = list(dict.fromkeys(key.split("/S")[0] for key in runs))
    stalenesses = sorted({key.split("/S")[1] for key in runs}, key=int)
    out = [
        f"`dapo` with TRL's three importance-sampling modes at their default bounds, {data['steps']} steps, learning "
        f"rate {data['learning_rate']:g}, {data['seeds']} seeds; every row from the generation process at real "
        "staleness. Cells: reward of the last quarter of steps (mean ± standard error over seeds), and the share of "
        "weights the truncation changed.",
        "",
    ]
    rows = []
    for mode in modes:
        cells = []
        for s in stalenesses:
            rs = runs.get(f"{mode}/S{s}", [])
            reward = [quarter_means(r["reward"])[1] for r in rs]
            clipped = statistics.mean(statistics.mean(r["clipped_fraction"]) for r in rs) if rs else math.nan
            cells.append(f"{fmt_mean_se(reward)}, {clipped:.2%}")
        rows.append([f"`{mode}`", *cells])
    out.append(table(["mode", *[f"max_staleness={s}" for s in stalenesses]], rows))
    json_stem = os.path.splitext(os.path.basename(section.files[0]))[0]
    pictures = section.pictures([(json_stem + ".png", "learning curves")])
    return "\n".join(out + (["", pictures] if pictures else []))


# ------------------------------------------------------------------------------------------------ PPO vs GRPO


def ppo_runs(data: dict, method: str) -> list[dict]:
    return [r for r in data["runs"] if r["method"] == method]


def ppo_gains(data: dict, method: str) -> list[float]:
    return [quarter_means(r["reward"])[1] - quarter_means(r["reward"])[0] for r in ppo_runs(data, method)]


def render_ppo(section: Section) -> str:
    data = section.first
    settings = data.get("settings", {})
    out = [
        f"`AsyncPPOTrainer` (one completion per prompt, a critic) and `AsyncGRPOTrainer` (8 prompts × 8 completions, "
        f"M2PO) on the tiny model, {settings.get('steps')} steps of {settings.get('rows_per_step')} rows, "
        f"temperature {settings.get('temperature')}, `max_staleness=1`, seeds {settings.get('seeds')}; the two runs "
        "of a seed back to back.",
        "",
    ]
    rows = []
    for method in ("ppo", "grpo"):
        rs = ppo_runs(data, method)
        if not rs:
            continue
        first = statistics.mean(quarter_means(r["reward"])[0] for r in rs)
        last = statistics.mean(quarter_means(r["reward"])[1] for r in rs)
        rows.append([method.upper(), num(first), num(last), fmt_mean_se(ppo_gains(data, method), signed=True),
                     ", ".join(f"{r['seconds']:.0f}" for r in rs)])  # fmt: skip
    out.append(table(["method", "reward, first quarter (mean)", "last quarter", "gain (mean ± s.e. over seeds)",
                      "seconds per seed"], rows))  # fmt: skip
    ev = [[v for v in r["explained_variance"] if v is not None] for r in ppo_runs(data, "ppo")]
    ev = [e for e in ev if e]
    if ev:
        first = statistics.mean(quarter_means(e)[0] for e in ev)
        last = statistics.mean(quarter_means(e)[1] for e in ev)
        out += ["", f"- PPO's `ppo/explained_variance`: {first:.3f} in the first quarter of steps, {last:.3f} in the "
                    "last (mean over seeds)."]  # fmt: skip
    pictures = section.pictures([("bench_ppo_vs_grpo.png", "learning curves")])
    return "\n".join(out + (["", pictures] if pictures else []))


def summary_ppo(section: Section) -> list[Row]:
    data = section.first
    settings = data.get("settings", {})
    n = len(ppo_runs(data, "ppo"))
    return [
        (
            f"`AsyncPPOTrainer` on the tiny model, {settings.get('steps')} steps × {settings.get('rows_per_step')} "
            "rows: reward gain (last quarter − first)",
            f"PPO {fmt_mean_se(ppo_gains(data, 'ppo'), signed=True)}, GRPO "
            f"{fmt_mean_se(ppo_gains(data, 'grpo'), signed=True)} ({se_note(n, 'seed')})",
        )
    ]


# ------------------------------------------------------------------------------------------------ TRL's own tests


def trl_compat_counts(data: dict) -> tuple[int, int]:
    """(kept, stock passes): tests that pass with stock TRL, and of those the ones that pass with the class swapped."""
    tests = data["tests"]
    outcome = lambda record, run: (record.get(run) or {}).get("outcome")  # noqa: E731
    stock = [name for name, record in tests.items() if outcome(record, "stock") == "passed"]
    kept = [name for name in stock if outcome(tests[name], "swapped") == "passed"]
    return len(kept), len(stock)


def render_trl_compat(section: Section) -> str:
    data = section.first
    summary, meta = data["summary"], data.get("meta", {})
    kept, stock = trl_compat_counts(data)
    source = meta.get("source", {})
    out = [
        f"TRL's `tests/test_grpo_trainer.py` (TRL commit `{source.get('trl_commit', '?')[:12]}`), run offline with "
        "stock `GRPOTrainer` and with it swapped for `AsyncGRPOTrainer`; versions "
        + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
        + ".",
        "",
        f"- Of {stock} tests that pass with stock TRL, **{kept} ({kept / stock:.1%})** pass with the class swapped; "
        f"{summary.get('kept_async_proven', '?')} of them trained and logged asynchronous generation, "
        f"{summary.get('kept_without_train', '?')} do not train.",
        f"- Collected {summary.get('collected')}, excluded by the harness {summary.get('excluded_by_harness')} (each "
        f"with its reason in the JSON), skipped by TRL's own marks {summary.get('skipped_by_trl_marks')}.",
        "",
    ]
    groups = data.get("failure_groups", [])
    if groups:
        rows = [[g["cause"].splitlines()[0][:100], g["count"]] for g in groups]
        out.append(table(["lost tests, by cause", "tests"], rows))
    return "\n".join(out)


def summary_trl_compat(section: Section) -> list[Row]:
    kept, stock = trl_compat_counts(section.first)
    return [
        (
            "TRL's own GRPO test file with `GRPOTrainer` swapped for `AsyncGRPOTrainer`",
            f"{kept} of the {stock} stock passes kept ({kept / stock:.1%})",
        )
    ]


# ------------------------------------------------------------------------------------------------ vLLM backend bench


def render_vllm_backends(section: Section) -> str:
    data = section.first
    reps = data["repeats"]
    settings = data.get("settings", {})
    med = lambda xs: statistics.median(xs)  # noqa: E731
    ratio = [r["vllm"]["generate_s"] / r["hf"]["generate_s"] for r in reps]
    out = [
        f"Both generation backends in one process on the same batch ({settings.get('rows')} rows, up to "
        f"{settings.get('max_new_tokens')} tokens, {settings.get('threads')} thread(s)), {len(reps)} repeats, each "
        f"after publishing new weights; versions {data.get('versions')}.",
        "",
        table(
            ["backend", "start-up s", "generation s/batch (median)", "weight update ms (median)"],
            [
                [
                    name,
                    num(data["startup_s"][name], ".1f"),
                    num(med([r[name]["generate_s"] for r in reps]), ".3f"),
                    num(med([r[name]["update_s"] * 1e3 for r in reps]), ".1f"),
                ]
                for name in ("hf", "vllm")
            ],
        ),  # fmt: skip
        "",
        f"- Generation seconds, vllm / hf, paired: {fmt_ratio(ratio, 'repeats')}.",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ generic


# ------------------------------------------------------------------------------------------------ staleness

STALENESS_LABELS = {
    "dapo_is": "`dapo` + TRL's importance correction",
    "dapo_no_is": "`dapo`, no correction",
    "m2po_paper": "`m2po` (`paper` rule)",
    "m2po_all_tokens": "`m2po` (`all_tokens` rule)",
    "ppo": "`AsyncPPOTrainer`",
}


def staleness_cells(data: dict) -> dict[tuple[str, int], list[dict]]:
    """(contender, k) -> the cell's runs, one per seed."""
    cells: dict = {}
    for cell in data["cells"].values():
        cells.setdefault((cell["contender"], cell["k"]), []).append(cell)
    return cells


def staleness_table(cells: dict, field: str, digits: int) -> str:
    contenders = [c for c in STALENESS_LABELS if any(key[0] == c for key in cells)]
    ks = sorted({k for _, k in cells})
    rows = []
    for contender in contenders:
        row = [STALENESS_LABELS[contender]]
        for k in ks:
            values = [r[field] for r in cells.get((contender, k), []) if r.get(field) is not None]
            row.append(f"{fmt_mean_se(values, digits)} (n={len(values)})" if values else "")
        rows.append(row)
    return table(["loss"] + [f"k = {k}" for k in ks], rows)


def render_staleness(section: Section) -> str:
    data = section.first
    cells = staleness_cells(data)
    seeds = sorted({r["seed"] for runs in cells.values() for r in runs})
    before = statistics.median(r["accuracy_before"] for runs in cells.values() for r in runs)
    out = [
        f"Regime: {data['regime']}. Every cell is one run of the recipe with `fixed_staleness=k`: each generation "
        "batch is generated with exactly the weights k optimizer steps older than the ones that train on it, so k is "
        f"what the rows really are. Seeds {seeds}; mean ± standard error over the seeds of a cell (n). "
        "[docs/staleness.md](../docs/staleness.md) reads the figures.",
    ]
    for title, field, digits in (
        (f"Held-out greedy accuracy after training (500 problems; {before:.3f} before training)", "accuracy_after", 3),
        ("Mean reward over the last quarter of steps", "last_quarter_reward", 3),
        ("E[δ²] of log π − log μ before the loss's treatment (`offpolicy/delta_sq_before`, mean over the steps "
         "after the first k)", "offpolicy/delta_sq_before", 4),
        ("Normalized effective sample size of π/μ per batch (`offpolicy/ess`)", "offpolicy/ess", 3),
        ("Tokens the loss masks (`offpolicy/masked_fraction`)", "offpolicy/masked_fraction", 4),
        ("Variance of the gradient norm over the steps after the first k", "grad_norm_variance", 4),
    ):  # fmt: skip
        out += ["", f"{title}:", "", staleness_table(cells, field, digits)]
    pictures = section.pictures(
        [("bench_staleness_accuracy.png", "accuracy against k")]
        + [(f"bench_staleness_reward_k{k}.png", f"reward curves at k = {k}") for k in (0, 8, 32)]
    )
    return "\n".join(out + (["", pictures] if pictures else []))


def summary_staleness(section: Section) -> list[Row]:
    cells = staleness_cells(section.first)
    ks = [k for k in (0, 8, 32) if any(key[1] == k for key in cells)]
    parts = []
    for contender in ("dapo_is", "dapo_no_is", "m2po_paper"):
        means = [mean_se([r["accuracy_after"] for r in cells.get((contender, k), [])])[0] for k in ks]
        parts.append(f"{STALENESS_LABELS[contender]} " + " / ".join(num(m, ".2f") for m in means))
    n = min(len(runs) for runs in cells.values())
    what = (
        f"Held-out accuracy after training at a fixed staleness k = {' / '.join(map(str, ks))} (tiny model; mean over "
        f"≥ {n} seeds per cell)"
    )
    return [(what, "; ".join(parts))]


# ------------------------------------------------------------------------------------------------ soak


def render_soak(section: Section) -> str:
    data = section.first
    out = [
        f"Command: `{data.get('command')}`. The tiny job for {data['steps']} asynchronous optimizer steps per mode "
        f"(a fresh process each), sampled every {data['sample_every']} steps; warm-up {data['warmup_steps']} steps. "
        f"Checks after the warm-up: RSS within {data['rss_growth_limit']:.0%} of the end of the warm-up, and no "
        "count grows (the smallest value over the last quarter of the samples at most the largest at the end of the "
        "warm-up).",
        "",
    ]
    rows = []
    for mode, run in data["runs"].items():
        samples, checks = run["samples"], run["checks"]
        first, last = samples[0], samples[-1]
        rss = [v for k, v in checks.items() if k.endswith("rss_mib")]
        rows.append([mode, len(samples), num(run.get("wall_seconds"), ".0f"),
                     " / ".join(f"{first[k]:.0f} → {last[k]:.0f}" for k in ("trainer_rss_mib", "generator_rss_mib")),
                     " / ".join(f"{v['max_growth']:+.1%}" for v in rss),
                     " / ".join(f"{first[k]} → {last[k]}" for k in ("trainer_fds", "generator_fds")),
                     f"{first['processes']} → {last['processes']}", f"{first['shm_entries']} → {last['shm_entries']}",
                     "flat" if checks["ok"] else "**grows**"])  # fmt: skip
    out.append(table(["mode", "samples", "wall s", "RSS MiB trainer / generator, first → last sample",
                      "largest RSS growth after warm-up, trainer / generator", "open files trainer / generator",
                      "processes", "/dev/shm entries", "verdict"], rows))  # fmt: skip
    pictures = section.pictures([("bench_soak.png", "every sample")])
    return "\n".join(out + (["", pictures] if pictures else []))


def summary_soak(section: Section) -> list[Row]:
    data = section.first
    growth = [v["max_growth"] for run in data["runs"].values() for k, v in run["checks"].items()
              if k.endswith("rss_mib")]  # fmt: skip
    verdict = "flat" if data["ok"] else "**something grows**"
    what = f"{data['steps']} asynchronous steps, LoRA and full fine-tuning: RSS, open files, processes, /dev/shm"
    return [(what, f"{verdict} (largest RSS growth after warm-up {max(growth):+.1%})")]


# ------------------------------------------------------------------------------------------------ before / after

BEFORE_AFTER_JOBS = {
    "docs_style": "the TRL-docs-style script with `AsyncGRPOTrainer` (120 steps)",
    "main_job": "the main job, `python recipes/qwen_math.py` (240 steps, no evaluation)",
}


def render_before_after(section: Section) -> str:
    data = section.first
    commits = data.get("commits", {})
    out = [
        f"The same user jobs on two checkouts, in alternating pairs (before {str(commits.get('before'))[:10]}, after "
        f"{str(commits.get('after'))[:10]}), each run a fresh process with OMP_NUM_THREADS and MKL_NUM_THREADS "
        "removed. Ratio: before seconds / after seconds of `trainer.train()` per pair (> 1: the newer code is faster).",
        "",
    ]
    rows = []
    for job, r in data["jobs"].items():
        rows.append([BEFORE_AFTER_JOBS.get(job, job), num(statistics.median(r["before_s"]), ".1f"),
                     num(statistics.median(r["after_s"]), ".1f"), fmt_ratio(r["per_pair"])])  # fmt: skip
    out.append(table(["job", "before, median s", "after, median s", "before / after"], rows))
    return "\n".join(out)


def summary_before_after(section: Section) -> list[Row]:
    cells = [f"{job}: {fmt_ratio(r['per_pair'])}" for job, r in section.first["jobs"].items()]
    return [("The same user jobs before and after the trainer restructuring (> 1: after is faster)", "; ".join(cells))]


# ------------------------------------------------------------------------------------------------ real size

REAL_SIZE_ARMS = ("async", "sync", "trl", "trl_spg")
# The start-up marks of a generation process (trl_async.timeline.names.STARTUP_MARKS), in the order they happen.
STARTUP_MARKS = ("spawn", "imports done", "model built", "ready", "first batch queued")


def real_size_labels(data: dict) -> dict[str, str]:
    k = data["settings"]["items_per_decode"]
    return {"async": "`AsyncGRPOTrainer`", "sync": "our synchronous mode (`--async_generation false`)",
            "trl": "TRL's `GRPOTrainer` at its defaults",
            "trl_spg": f"TRL's `GRPOTrainer` with `steps_per_generation={k}`"}  # fmt: skip


def real_size_pairs(data: dict) -> list[dict]:
    """{arm: run} per pair that has an asynchronous run, in pair order."""
    return complete_pairs(data, "arm", ("async",))


def real_size_first_generator_step(run: dict) -> int | None:
    """The step (numbered from 1, as TRL logs them) in which the asynchronous run's trainer first trained on a batch
    of its generation process, from its timeline (`batch_source` per step: `generator` for a batch taken from the
    queue, `trainer` for one the trainer made itself while its generation process started); None if no step did."""
    return next((i + 1 for i, source in enumerate(run.get("batch_source") or []) if source == "generator"), None)


def real_size_first_generator_step_by_metric(run: dict) -> int | None:
    """The same step from the `async/trainer_generated_batches` metric logged at every step (0: none of the step's
    batches was made by the trainer)."""
    return next((i + 1 for i, n in enumerate(run.get("trainer_generated_batches") or []) if n == 0), None)


def real_size_steady(run: dict, after_step: int, block: int) -> tuple[float, int]:
    """Steady-state seconds per step of `run`: its steps after step `after_step` (steps numbered from 1), the earliest
    dropped until whole blocks of `block` consecutive steps remain, as the median over the blocks of their seconds per
    step (an arm that generates every `block` steps has one `generate` call in every block); and the number of steps
    measured. (NaN, 0) when no step is left."""
    window = run["step_seconds"][after_step:]
    window = window[len(window) % block :]
    if not window:
        return math.nan, 0
    blocks = [sum(window[i : i + block]) / block for i in range(0, len(window), block)]
    return statistics.median(blocks), len(window)


def real_size_steady_steps(data: dict, pair: dict) -> int:
    """The steps a pair's steady state measures (0 when its asynchronous run never trained on a generator batch)."""
    first = real_size_first_generator_step(pair["async"])
    return 0 if first is None else real_size_steady(pair["async"], first, data["settings"]["items_per_decode"])[1]


def real_size_ratios(data: dict, arm: str) -> tuple[list[float], list[float]]:
    """Per pair that ran `arm`: its steady-state seconds per step over the asynchronous run's, both measured on the
    same steps (those after the asynchronous run's first step on a batch of its generation process), and its
    `trainer.train()` seconds over the asynchronous run's (> 1: the asynchronous run is faster). A pair whose
    asynchronous run never trained on a generation-process batch has no steady state: an end-to-end ratio only."""
    block = data["settings"]["items_per_decode"]
    steady, end_to_end = [], []
    for pair in real_size_pairs(data):
        if arm not in pair:
            continue
        run, other = pair["async"], pair[arm]
        end_to_end.append(other["train_seconds"] / run["train_seconds"])
        first = real_size_first_generator_step(run)
        if first is None:
            continue
        mine, measured = real_size_steady(run, first, block)
        if measured:
            steady.append(real_size_steady(other, first, block)[0] / mine)
    return steady, end_to_end


def real_size_startup(run: dict) -> dict[str, float] | None:
    """The generation process's start-up, from the run's timeline: the seconds from spawn to each later mark
    (`imports done`, `model built`, `ready`, `first batch queued`); None without marks."""
    startup = run.get("startup")
    if not startup or not startup.get("phases"):
        return None
    after_spawn, elapsed = {}, 0.0
    for phase in startup["phases"]:
        elapsed += phase["seconds"]
        after_spawn[phase["to"]] = elapsed
    return after_spawn


def real_size_ready_after_training_start(run: dict) -> float | None:
    """Seconds from the start of the trainer's first step to its generation process being ready: the spawn's delay
    (`spawn_after_training_start_s`, what the trainer does before spawning it) plus spawn -> ready."""
    startup, spawned = real_size_startup(run), run.get("spawn_after_training_start_s")
    if spawned is None or not startup or "ready" not in startup:
        return None
    return spawned + startup["ready"]


def real_size_lines(data: dict) -> list[str]:
    """The section's figures as markdown bullets (also what `bench_real_size.py` prints at the end of a run)."""
    settings, labels = data["settings"], real_size_labels(data)
    pairs = real_size_pairs(data)
    k, rows = settings["items_per_decode"], settings.get("rows_per_generation_batch")
    out = []
    for arm in ("trl", "trl_spg", "sync"):
        steady, end_to_end = real_size_ratios(data, arm)
        if end_to_end:
            out.append(f"- Against {labels[arm]} (its seconds / the asynchronous run's): steady state "
                       f"**{fmt_ratio(steady)}**, end to end {fmt_ratio(end_to_end)}.")  # fmt: skip
    firsts = [real_size_first_generator_step(p["async"]) for p in pairs]
    by_metric = [real_size_first_generator_step_by_metric(p["async"]) for p in pairs]
    measured = [real_size_steady_steps(data, p) for p in pairs]
    agree = "the `async/trainer_generated_batches` metric agrees" if firsts == by_metric else (
        f"**the `async/trainer_generated_batches` metric says {', '.join(map(str, by_metric))}**")  # fmt: skip
    out.append(f"- The asynchronous run's first step on a batch of its generation process, per pair: "
               f"{', '.join('never' if f is None else str(f) for f in firsts)} ({agree}); steps measured after it: "
               f"{', '.join(map(str, measured))}"
               + (f" (**fewer than {settings['min_steady_steps']}**)" if min(measured, default=0)
                  < settings.get("min_steady_steps", 0) else "") + ".")  # fmt: skip
    startups = [s for p in pairs if (s := real_size_startup(p["async"]))]
    if startups:
        marks = [m for m in STARTUP_MARKS[1:] if all(m in s for s in startups)]
        median = {m: statistics.median(s[m] for s in startups) for m in marks}
        text = (f"- The generation process's start-up (the asynchronous runs' timelines; seconds after its spawn, median "
                f"over {len(startups)} run{'s' if len(startups) > 1 else ''}): "
                + ", ".join(f"{m} {median[m]:.1f} s" for m in marks) + ".")  # fmt: skip
        ready = [s["ready"] for s in startups if "ready" in s]
        if ready:
            spread = f" [{min(ready):.1f}, {max(ready):.1f}]" if len(ready) > 1 else ""
            text += f" Built and ready **{statistics.median(ready):.1f} s{spread} after spawn**."
        spawned = [s for p in pairs if (s := p["async"].get("spawn_after_training_start_s")) is not None]
        after_start = [r for p in pairs if (r := real_size_ready_after_training_start(p["async"])) is not None]
        if spawned and after_start:
            text += (f" The trainer spawned it **{statistics.median(spawned):.1f} s** after its first step began, so it "
                     f"was ready {statistics.median(after_start):.1f} s after training began.")  # fmt: skip
        out.append(text)
    decoded = [v for p, f in zip(pairs, firsts, strict=True) if f is not None
               for v in (p["async"].get("rows_per_decode") or [])[f - 1 :] if v is not None]  # fmt: skip
    if decoded:
        config = f"{k} generation batch{'es' if k > 1 else ''} of {rows} rows = {k * rows} rows" if rows else f"{k}"
        out.append(f"- `async/rows_per_decode` from the first step on a generation-process batch on: median "
                   f"{statistics.median(decoded):.0f} (the config decodes {config} per call).")  # fmt: skip
    return out


def real_size_text(data: dict) -> str:
    return "\n".join(real_size_lines(data))


def render_real_size(section: Section) -> str:
    data = section.first
    if not any("arm" in run for run in data["runs"]):
        return render_real_size_two_arms(section)
    settings, labels = data["settings"], real_size_labels(data)
    k = settings["items_per_decode"]
    parameters = data.get("summary", {}).get("parameters", 0)
    shape = settings.get("shape", "0.5b")
    out = [
        f"Command: `{data.get('command')}`. The job of the recipe's Qwen config on "
        + (
            "Qwen2.5-0.5B's architecture"
            if shape == "0.5b"
            else f"**the `{shape}` shape (a plumbing check, not a measurement)**"
        )
        + f" ({parameters / 1e6:.0f}M parameters, random weights, Qwen's real tokenizer, LoRA r=8), "
        f"{settings.get('rows_per_step')} rows a step, completions forced to {settings.get('completion_length')} "
        f"tokens, {settings.get('steps')} steps per run. Arms, in fresh processes, order alternating from pair to "
        "pair, all with OMP_NUM_THREADS and MKL_NUM_THREADS removed (every arm on every core): `async`, the recipe "
        f"(`python recipes/qwen_math.py`, M2PO, {real_size_decode(settings)}); `sync`, {labels['sync']}; `trl`, "
        f"{labels['trl']} "
        "(`benchmarks/real_size_grpo.py`, a plain TRL script of the same job: TRL's loss, one `generate` call a "
        f"step); `trl_spg`, the same with TRL's own `steps_per_generation={k}` (one `generate` call of as many rows "
        "as the asynchronous run decodes per call).",
        "",
        "Steady state: the steps after the one in which the asynchronous run's trainer first trained on a batch of "
        "its generation process (its timeline), the same steps for every arm of the pair, as the median over "
        f"blocks of {k} consecutive steps of their seconds per step (each block holds one `generate` call of an arm "
        f"that generates every {k} steps). End to end: the seconds of `trainer.train()`. Ratios: the arm's seconds "
        "/ the asynchronous run's, per pair (> 1: the asynchronous run is faster).",
        "",
    ]
    arms = [a for a in REAL_SIZE_ARMS if any(a in p for p in real_size_pairs(data))]
    rows = []
    for i, pair in enumerate(real_size_pairs(data)):
        first = real_size_first_generator_step(pair["async"])
        steady = {a: real_size_steady(pair[a], first, k)[0] if first and a in pair else None for a in arms}
        rows.append([i, first or "never", real_size_steady_steps(data, pair)]
                    + [num(steady[a], ".1f") for a in arms]
                    + [num(pair[a]["train_seconds"], ".0f") if a in pair else "–" for a in arms])  # fmt: skip
    out.append(table(["pair", "first step on a generator batch", "steps measured"]
                     + [f"{a} s/step" for a in arms] + [f"{a} train s" for a in arms], rows))  # fmt: skip
    out += ["", *real_size_lines(data)]
    pairs = real_size_pairs(data)
    limits = [p["sync"]["limit"]["ideal_overlap_ratio"] for p in pairs if "sync" in p and p["sync"].get("limit")]
    if limits:
        out.append(f"- The limit, from the synchronous runs' timelines: (generation + training) / max(generation, "
                   f"training) = {statistics.median(limits):.2f}×"
                   + (f" (median over {len(limits)} runs)." if len(limits) > 1 else "."))  # fmt: skip
    rss = [p["async"].get("peak_rss_mib", {}) for p in pairs]
    if rss and rss[0]:
        labels_rss = sorted(rss[0])
        out.append("- Peak resident memory of the asynchronous run (median): " + ", ".join(
            f"{label} {statistics.median(r[label] for r in rss if label in r) / 1024:.1f} GiB" for label in labels_rss)
            + ".")  # fmt: skip
    causes = [c for p in pairs for c in p["async"].get("idle_causes", [])][:3]
    if causes:
        out.append("- Largest idle causes of the asynchronous runs (timeline): "
                   + "; ".join(f"{c['process']} {c['cause']} {c['seconds']:.0f} s ({c['fraction']:.0%})"
                               for c in causes) + ".")  # fmt: skip
    timelines = [section.beside(section.files[0], r["timeline_file"]) for r in data["runs"] if r.get("timeline_file")]
    links = [section.link(t) for t in timelines if os.path.exists(t)]
    if links:
        out += ["", "Timelines (`python -m trl_async.timeline FILE`): " + " · ".join(links)]
    return "\n".join(out)


def real_size_decode(settings: dict) -> str:
    """How the asynchronous arm decodes: its defaults, or the `max_rows_per_decode` the run chose, and the bound."""
    k, rows = settings["items_per_decode"], settings.get("max_rows_per_decode")
    chosen = f"`--max_rows_per_decode {rows}`: " if isinstance(rows, int) else "at its defaults: "
    return (f"{chosen}{k} generation batch{'es' if k > 1 else ''} decoded per call, max_staleness "
            f"{settings.get('max_staleness')}")  # fmt: skip


def summary_real_size(section: Section) -> list[Row]:
    data = section.first
    if not any("arm" in run for run in data["runs"]):
        return summary_real_size_two_arms(section)
    k = data["settings"]["items_per_decode"]
    cells = []
    for arm, short in (("trl", "TRL's `GRPOTrainer`"), ("trl_spg", f"TRL with `steps_per_generation={k}`"),
                       ("sync", "our synchronous mode")):  # fmt: skip
        steady, end_to_end = real_size_ratios(data, arm)
        if end_to_end:
            cells.append(f"vs {short} **{fmt_ratio(steady)}** (end to end {fmt_ratio(end_to_end)})")
    ready = [s["ready"] for p in real_size_pairs(data) if (s := real_size_startup(p["async"])) and "ready" in s]
    what = (
        "The recipe's Qwen config at real size (Qwen2.5-0.5B architecture, random weights, LoRA r=8, 2 CPU cores, "
        "64-token completions): `AsyncGRPOTrainer`'s steady-state step time against TRL's `GRPOTrainer`, TRL with "
        f"its `steps_per_generation` matched, and our synchronous mode; async {real_size_decode(data['settings'])}"
    )
    extra = f"; generation process ready {statistics.median(ready):.1f} s after spawn" if ready else ""
    after_start = [r for p in real_size_pairs(data) if (r := real_size_ready_after_training_start(p["async"]))]
    if ready and after_start:
        extra += f", {statistics.median(after_start):.1f} s after training began"
    shape = data["settings"].get("shape", "0.5b")
    if shape != "0.5b":
        what += f" (**the `{shape}` shape: a plumbing check, not a measurement**)"
    return [(what, "; ".join(cells) + extra)]


# Files written before the TRL arms existed (two arms, async and sync, `mode` per run).
def real_size_two_arm_speedups(data: dict) -> list[float]:
    """Median step seconds, sync / async, per pair: computed from the runs (never copied from a summary)."""
    return [p["sync"]["step_seconds_median"] / p["async"]["step_seconds_median"] for p in main_job_pairs(data)]


def render_real_size_two_arms(section: Section) -> str:
    data = section.first
    settings = data.get("settings", {})
    out = [
        f"Command: `{data.get('command')}`. The recipe's Qwen config on Qwen2.5-0.5B's architecture "
        f"({data['summary'].get('parameters', 0) / 1e6:.0f}M parameters, random weights, Qwen's real tokenizer, LoRA "
        f"r=8), {settings.get('rows_per_step')} rows a step, completions forced to "
        f"{settings.get('completion_length')} tokens, {settings.get('steps')} steps per run, both arms on every core "
        "(OMP_NUM_THREADS unset), alternating fresh processes. Step time: the median over the steps after the first "
        "two, from each run's timeline (kept beside the JSON).",
        "",
    ]
    rows = []
    for i, p in enumerate(main_job_pairs(data)):
        sync, run = p["sync"], p["async"]
        limit = sync.get("limit") or {}
        rss = run.get("peak_rss_mib", {})
        rows.append([i, num(sync["step_seconds_median"], ".1f"), num(run["step_seconds_median"], ".1f"),
                     num(sync["step_seconds_median"] / run["step_seconds_median"], ".2f"),
                     num(limit.get("ideal_overlap_ratio"), ".2f"),
                     num(limit.get("generation_s"), ".0f") + " / " + num(limit.get("training_s"), ".0f"),
                     " / ".join(f"{label} {mib / 1024:.1f}" for label, mib in sorted(rss.items())),
                     num(run.get("lora_publish_seconds_median"), ".3f")])  # fmt: skip
    out.append(table(["pair", "sync step s", "async step s", "sync / async", "limit (sync timeline)",
                      "sync generation / training s", "async peak RSS GiB", "LoRA publish s"], rows))  # fmt: skip
    causes = [c for p in main_job_pairs(data) for c in p["async"].get("idle_causes", [])][:3]
    if causes:
        out += [
            "",
            "Largest idle causes of the asynchronous run (timeline): "
            + "; ".join(f"{c['process']} {c['cause']} {c['seconds']:.0f} s ({c['fraction']:.0%})" for c in causes)
            + ".",
        ]
    return "\n".join(out)


def summary_real_size_two_arms(section: Section) -> list[Row]:
    data = section.first
    limits = [p["sync"]["limit"]["ideal_overlap_ratio"] for p in main_job_pairs(data) if p["sync"].get("limit")]
    return [
        (
            "The recipe's Qwen config at real size (Qwen2.5-0.5B architecture, random weights, LoRA r=8, 2 CPU "
            "cores, 64-token completions), asynchronous vs synchronous: step time",
            f"**{fmt_ratio(real_size_two_arm_speedups(data))}**"
            + (f" (limit {statistics.median(limits):.2f}×)" if limits else ""),
        )
    ]


# ------------------------------------------------------------------------------------------------ timeline overhead


def render_timeline_overhead(section: Section) -> str:
    data = section.first
    ns = data["per_call_ns"]
    out = [
        "`benchmarks/bench_timeline_overhead.py`: the cost of recording a timeline, each figure the fastest of several "
        "repeats of a tight loop (an upper bound: the loop's own cost is included).",
        "",
        table(
            ["figure", "value"],
            [[k.replace("_ns", ""), f"{v:.0f} ns"] for k, v in ns.items()]
            + [
                ["one step (spans, set_step, flush)", f"{data['per_step_ns'] / 1e3:.1f} µs"],
                [
                    "merging a 10,000-step run",
                    f"{data['merge_10k_steps_s']:.2f} s, {data['merge_10k_steps_trace_mb']:.1f} MB",
                ],
            ],
        ),  # fmt: skip
        "",
    ]
    for step, figures in data["overhead"].items():
        out.append(f"- At a step of {step.removeprefix('step_')}: {figures['recording_fraction']:.3%} recording, "
                   f"{figures['with_merges_fraction']:.2%} with the merges.")  # fmt: skip
    return "\n".join(out)


def summary_timeline_overhead(section: Section) -> list[Row]:
    worst = max(f["with_merges_fraction"] for f in section.first["overhead"].values())
    return [("Recording the timeline (`timeline=True`, the default): its share of a tiny-model step",
             f"≤ {worst:.2%} (upper bound, hot-path microbenchmark)")]  # fmt: skip


# ------------------------------------------------------------------------------------------------ the GPU check

GPU_SECTIONS = ("env", "m2po_cuda", "loss_timing", "reward_sync", "sharded", "main_command", "throughput")
# Issue 39's bars on one GPU (the 0.5B stand-in, bf16, 32 rows x 64 tokens a step).
GPU_BARS = {"speed": 3.0, "sm_percent": 50.0, "ready_s": 10.0}


def _gpu_status(section: dict) -> str:
    if section.get("skipped") and section.get("ok") is None:
        return f"skipped: {section['skipped']}"
    if section.get("rc") not in (0, None):
        return f"**FAILED** (exit {section['rc']}" + (", time limit" if section.get("rc") in (124, 137) else "") + ")"
    ok = section.get("ok")
    return "passed" if ok is True else "**FAILED**" if ok is False else "ran" if section else "not run"


def _gpu_finding(name: str, sec: dict) -> str:
    if name == "env":
        versions = sec.get("versions") or {}
        return (f"{', '.join(sec.get('gpus') or []) or 'no GPU'}; torch {versions.get('torch')}, CUDA {sec.get('cuda')}, "
                f"transformers {versions.get('transformers')}, trl {versions.get('trl')}")  # fmt: skip
    if name == "m2po_cuda":
        parts = [f"`{(sec.get('pytest') or {}).get('command')}`: {(sec.get('pytest') or {}).get('summary')}"]
        comparison = sec.get("comparison") or {}
        devices = " vs ".join(comparison.get("devices", []))
        for dtype, r in (comparison.get("dtypes") or {}).items():
            if "error" in r:
                parts.append(f"{dtype}: {r['error'][:120]}")
            else:
                parts.append(f"{dtype}: loss rel. diff {r['loss_rel_diff']:.1e}, grad {r['grad_max_abs_diff']:.1e}")
        return "; ".join(parts[:1]) + (f"; {devices}: " + "; ".join(parts[1:]) if len(parts) > 1 else "")
    if name == "reward_sync" and sec.get("ran"):
        synced = [
            k for k in ("math", "pattern", "pattern_per_row", "format", "length") if sec.get(k) != "no host sync"
        ]
        return ("no host sync in any tensor reward" if not synced else f"host syncs in {', '.join(synced)}") + (
            f"; math matches the CPU: {sec.get('math_matches_cpu')}"
        )
    if name == "sharded":
        runs = []
        for run_name, run in (sec.get("runs") or {}).items():
            gaps = [g for rank in run.get("mu_gaps") or [] for g in rank or []]
            controls = [g for rank in run.get("control_gaps") or [] for g in rank or []]
            runs.append(f"{run_name}: {run.get('checks') or run.get('error', '')[:100]}"
                        + (f", μ within {max(gaps):.1e}" if gaps else "")
                        + (f", controls ≥ {min(controls):.2g}" if controls else ""))  # fmt: skip
        return "; ".join(runs)
    if name == "main_command" and "command" in sec:
        before, after = sec.get("accuracy_before"), sec.get("accuracy_after")
        return (f"`{sec['command']}` exit {sec.get('rc')}; accuracy {num(before)} → {num(after)} on "
                f"{sec.get('eval_samples')} held-out problems; training {num(sec.get('train_runtime_s'), '.1f')} s, "
                f"{num(sec.get('wall_s'), '.0f')} s in all"
            + (f" (beside {', '.join(sec['beside'])})" if sec.get("beside") else ""))  # fmt: skip
    if name == "throughput" and "runs" in sec:
        measured = [r for r in sec["runs"].values() if "same_as" not in r]
        return f"{len(measured)} runs, {len(sec.get('skipped') or {})} skipped (below)"
    if name == "loss_timing" and sec.get("cases"):
        return f"{sec.get('clock')}, median of {sec.get('repeats')} repeats (below)"
    return ""


def gpu_pairs(runs: dict, shape: dict) -> dict:
    """Per pair of runs that both reached a steady state, async rows/s over TRL rows/s (steady and end to end), from
    the runs' records: the defaults against each other, and each rows-per-decode value against TRL with the matching
    steps_per_generation and against TRL's defaults."""

    def run_of(name):
        run = runs.get(name) or {}
        return runs.get(run["same_as"]) or {} if "same_as" in run else run

    pairs = {}

    def add(label, a, b):
        ra, rb = run_of(a), run_of(b)
        if all(r.get("steady_state") and r.get("rows_per_s_steady") for r in (ra, rb)):
            pairs[label] = {"async": a, "trl": b, "steady": ra["rows_per_s_steady"] / rb["rows_per_s_steady"],
                            "end_to_end": ra["rows_per_s_end_to_end"] / rb["rows_per_s_end_to_end"]}  # fmt: skip

    add("defaults", "async/defaults", "trl/defaults")
    for rows in sorted(shape.get("sweep") or ()):
        name, k = f"async/rows_per_decode={rows}", rows // shape["rows_per_step"]
        add(f"{rows} rows per decode vs TRL, same steps_per_generation", name,
            "trl/defaults" if k == 1 else f"trl/steps_per_generation={k}")  # fmt: skip
        if k != 1:
            add(f"{rows} rows per decode vs TRL's defaults", name, "trl/defaults")
    return pairs


def _phases(startup: dict | None) -> str:
    if not startup:
        return "–"
    return ", ".join(f"{k.split(' -> ')[1]} +{v:.1f} s" for k, v in (startup.get("phases_s") or {}).items())


def _sm(run: dict, key: str) -> str:
    value = (run.get(key) or {}).get("median")
    return "–" if value is None else f"{value:.0f}%"


def render_gpu_check(section: Section) -> str:
    """benchmarks/gpu_check.sh's summary: every section's status, the throughput runs at steady state (with SM
    utilisation and the generation process's start-up), the pairs, and the loss timings; the first run's summary
    (2026-12-04, no `format`) as the previous code's run."""
    data = section.first
    if data.get("format") != 2:
        return _render_gpu_check_first_run(data)
    meta, sections = data.get("meta") or {}, data.get("sections") or {}
    out = []
    if data.get("mode") != "gpu":
        out += ["**A CPU smoke run (`--cpu-smoke`): the plumbing at tiny sizes, the CUDA parts skipped. Not a "
                "measurement: the GPU rows are not measured yet.**", ""]  # fmt: skip
    commit = meta.get("commit")
    out += [f"`{meta.get('command')}` on {meta.get('machine')}, {str(meta.get('date'))[:16].replace('T', ' ')} UTC"
            + (f", code at `{commit[:12]}`" if commit else "")
            + (f"; {meta['seconds']:.0f} s of its {meta.get('budget_s'):.0f} s budget" if meta.get("seconds")
               and meta.get("budget_s") else "") + ".", ""]  # fmt: skip
    rows = []
    for name in GPU_SECTIONS:
        sec = sections.get(name) or {}
        timing = f"{sec['seconds']} s (limit {sec.get('limit_s')} s)" if "seconds" in sec else "–"
        rows.append([name, _gpu_status(sec), timing, _gpu_finding(name, sec)])
    out += [table(["section", "status", "time", "what it found"], rows)]
    out += _render_gpu_throughput(sections.get("throughput") or {}, data.get("dmon") or {}, data.get("mode") == "gpu")
    out += _render_gpu_losses(sections.get("loss_timing") or {})
    return "\n".join(out)


def _render_gpu_throughput(sec: dict, dmon: dict, on_gpu: bool) -> list[str]:
    runs = sec.get("runs") or {}
    if not runs and not sec.get("skipped"):
        return []
    shape = sec.get("shape") or {}
    model = sec.get("model") or {}
    size = f"{model['parameters'] / 1e6:.0f}M parameters" if model.get("parameters") else model.get("name")
    out = ["", f"**Throughput** ({shape.get('model')}: {size}, {model.get('dtype')}, {shape.get('rows_per_step')} rows "
           f"× {shape.get('completion_length')} tokens a step). "
           f"Each run trains at least {shape.get('min_steps')} steps and {shape.get('min_steady_steps')} in its steady "
           "window: TRL's clock starts after its warm-up, on whole generation cycles; the async run's after the first "
           "step trained on a batch of the generation process (and never before the generator queued its first "
           "batch). SM %: `nvidia-smi dmon -s u`, median over the steady window (over the whole run). The runs share "
           "one Python process, one after the other: only the first async run starts its generation process cold; "
           "later ones fork it from that run's warm fork server, which flatters their end-to-end figures."
           + (f" ({dmon['skipped']})" if dmon.get("skipped") else ""), ""]  # fmt: skip
    rows = []
    for name, run in runs.items():
        if "same_as" in run:
            rows.append([name, f"same as {run['same_as']} ({run.get('note')})", *["–"] * 7])
            continue
        if "error" in run:
            rows.append([name, f"**error**: {run['error'][:160]}", *["–"] * 7])
            continue
        steady = run.get("steady") or {}
        decode = run.get("rows_per_decode_logged")
        if run.get("trainer") == "trl":  # TRL decodes the rows of one generate call: steps_per_generation steps' worth
            decode = (run.get("steps_per_generation") or 1) * (run.get("rows_per_step") or 0)
        startup = run.get("startup") or {}
        rows.append([
            name,
            (num(decode, ".0f") if decode is not None else str(run.get("max_rows_per_decode") or "–"))
            + (f" / {run['max_staleness']}" if run.get("max_staleness") is not None else ""),
            f"{run.get('steps')} ({steady.get('steps', 0)} from step {steady.get('start_step', '–')})"
            + ("" if run.get("steady_state") else " **not steady**"),
            num(run.get("rows_per_s_steady"), ".1f"), num(run.get("rows_per_s_end_to_end"), ".1f"),
            f"{_sm(run, 'sm_percent_steady')} ({_sm(run, 'sm_percent_run')})",
            num(startup.get("ready_after_spawn_s"), ".1f") + " / " + num(startup.get("first_batch_after_spawn_s"), ".1f")
            if startup else "–",
            num(run.get("peak_gpu_mem_gib"), ".1f"),
            run.get("not_steady") or "",
        ])  # fmt: skip
    out.append(table(["run", "rows per decode / max_staleness", "steps (steady)", "rows/s steady", "rows/s end to end",
                      "SM % steady (run)", "generator ready / first batch after spawn, s", "peak GiB", "note"],
                     rows))  # fmt: skip
    pairs = gpu_pairs(runs, shape)
    if pairs:
        out += ["", table(["pair (async / TRL)", "steady", "end to end"],
                          [[f"{label}: `{p['async']}` / `{p['trl']}`", f"**{p['steady']:.2f}×**",
                            num(p.get("end_to_end"), ".2f") + "×"] for label, p in pairs.items()])]  # fmt: skip
    starts = [(name, run["startup"]) for name, run in runs.items() if run.get("startup")]
    if starts:
        out += ["", "Start-up of the generation process, phase by phase from spawn (its timeline):", ""]
        out += [
            f"- `{name}` ({runs[name].get('generator_start', '?')}): {_phases(startup)}" for name, startup in starts
        ]
    bars = _gpu_bars(runs, pairs) if on_gpu else []
    if bars:
        out += ["", "Issue 39's bars on one GPU: " + "; ".join(bars) + "."]
    if sec.get("skipped"):
        out += ["", "Not run:", ""] + [f"- `{name}`: {why}" for name, why in sec["skipped"].items()]
    if sec.get("timelines"):
        out += ["", f"Timelines: {sec['timelines']}"]
    return out


def _gpu_bars(runs: dict, pairs: dict) -> list[str]:
    bars = []
    speeds = [(p["steady"], label) for label, p in pairs.items() if p["trl"] == "trl/defaults"]
    if speeds:
        best, label = max(speeds)
        met = "met" if best >= GPU_BARS["speed"] else "not met"
        bars.append(f"≥ {GPU_BARS['speed']:.0f}× TRL's default rows/s: best {best:.2f}× ({label}), {met}")
    sm = [((r.get("sm_percent_steady") or {}).get("median"), n) for n, r in runs.items() if n.startswith("async/")]
    sm = [(v, n) for v, n in sm if v is not None]
    if sm:
        value, name = max(sm)
        met = "met" if value >= GPU_BARS["sm_percent"] else "not met"
        bars.append(f"SM utilisation ≥ {GPU_BARS['sm_percent']:.0f}%: best {value:.0f}% (`{name}`), {met}")
    ready = [(r["startup"].get("ready_after_spawn_s"), n) for n, r in runs.items()
             if r.get("startup") and r.get("generator_start") == "cold"]  # fmt: skip
    ready = [(v, n) for v, n in ready if v is not None]
    if ready:
        value, name = min(ready)
        met = "met" if value <= GPU_BARS["ready_s"] else "not met"
        bars.append(f"generator ready ≤ {GPU_BARS['ready_s']:.0f} s after spawn: {value:.1f} s (`{name}`), {met}")
    return bars


def _render_gpu_losses(sec: dict) -> list[str]:
    cases = sec.get("cases") or []
    if not cases:
        return []
    ref = sec.get("reference_page") or {}
    rows = [[c["shape"], f"{c['regime']} ({c['regime_name']})", num(c["median_ms"]["dapo"], ".3f"),
             num(c["median_ms"]["grpo"], ".3f"), num(c["median_ms"]["m2po"], ".3f"),
             f"{c['paired_ratio_to_dapo']['m2po']:.2f}×"] for c in cases]  # fmt: skip
    return ["", f"**Loss timing** on {sec.get('device')} (forward + backward, {sec.get('clock')}, median of "
            f"{sec.get('repeats')} repeats after {sec.get('warmup')} warm-up, contenders interleaved). The public "
            f"page's figures at {ref.get('shape')} on an {ref.get('gpu')}: GRPO loss {ref.get('grpo_ms')} ms, M2PO "
            f"{ref.get('m2po_ms')} ms.", "",
            table(["B × L", "regime", "dapo ms", "grpo ms", "m2po ms", "m2po / dapo (paired)"], rows)]  # fmt: skip


def _render_gpu_check_first_run(data: dict) -> str:
    """The summary the first GPU run wrote (2026-12-04, on the code before issues 39 and 40)."""
    sections = data.get("sections") or {}
    meta = data.get("meta") or {}
    out = [f"**The previous code's run** ({meta.get('date')}, code at `{meta.get('commit')}`, {meta.get('machine')}): "
           "kept for comparison. **The GPU rows of the current check are not measured yet** (no GPU has been lent "
           "since); `bash benchmarks/gpu_check.sh` measures them when one is.", ""]  # fmt: skip
    throughput = sections.get("throughput") or {}
    rows = [[name, run.get("steps"), num(run.get("rows_per_s_steady"), ".1f"), num(run.get("rows_per_s_end_to_end"),
             ".1f"), num(run.get("end_to_end_s"), ".1f")] for name, run in (throughput.get("runs") or {}).items()]  # fmt: skip
    if rows:
        out += ["Its throughput runs ended before the generation process delivered its first batch (10–24 steps): "
                "they time the trainer generating by itself beside a starting process, not a steady state.", "",
                table(["run", "steps", "rows/s (its 'steady')", "rows/s end to end", "train s"], rows)]  # fmt: skip
    visit = data.get("second_visit") or {}
    if visit.get("runs"):
        trl, run = visit["runs"].get("trl", {}), visit["runs"].get("async", {})
        out += ["", f"{visit.get('what')}: TRL {trl.get('rows_per_s_steady')} rows/s, async "
                f"{run.get('rows_per_s_steady')} rows/s at steady state "
                f"(**{run['rows_per_s_steady'] / trl['rows_per_s_steady']:.2f}×**), "
                f"{trl.get('end_to_end_s')} s against {run.get('end_to_end_s')} s end to end "
                f"({trl['end_to_end_s'] / run['end_to_end_s']:.2f}×); source: {visit.get('source')}."]  # fmt: skip
    checks = []
    for name in ("m2po_cuda", "reward_sync", "sharded"):
        sec = sections.get(name) or {}
        checks.append(f"{name} {_gpu_status(sec)}")
    out += ["", "Its checks: " + "; ".join(checks) + ". " + str(data.get("note", ""))]
    return "\n".join(out)


def summary_gpu_check(section: Section) -> list[Row]:
    data = section.first
    title = ("One H200, the 0.5B stand-in (bf16, 32 rows × 64 tokens): `AsyncGRPOTrainer` vs TRL's `GRPOTrainer`, both "
             "at their defaults, rows/s at steady state")  # fmt: skip
    if data.get("format") != 2 or data.get("mode") != "gpu":
        earlier = ""
        visit = (data.get("second_visit") or {}).get("runs") or {}
        if visit.get("trl") and visit.get("async"):
            earlier = (f" (the previous code: {visit['async']['rows_per_s_steady'] / visit['trl']['rows_per_s_steady']:.2f}× "
                       "in one 40-step pair)")  # fmt: skip
        return [(title, "_not measured yet_" + earlier)]
    throughput = (data.get("sections") or {}).get("throughput") or {}
    runs = throughput.get("runs") or {}
    pairs = gpu_pairs(runs, throughput.get("shape") or {})
    rows = []
    defaults = pairs.get("defaults")
    sm = " / ".join(_sm(runs.get(n) or {}, "sm_percent_steady") for n in ("async/defaults", "trl/defaults"))
    rows.append(
        (title, f"**{defaults['steady']:.2f}×** (SM {sm})" if defaults else "_not measured_ (see its section)")
    )
    matched = [(p["steady"], label) for label, p in pairs.items() if "same steps_per_generation" in label]
    if matched:
        best, label = max(matched)
        rows.append(("One H200: `AsyncGRPOTrainer` at its best rows per decode vs TRL with the same "
                     "`steps_per_generation`", f"{best:.2f}× ({label.split(' vs ')[0]})"))  # fmt: skip
    ready = ((runs.get("async/defaults") or {}).get("startup") or {}).get("ready_after_spawn_s")
    if ready is not None:
        rows.append(("One H200: the generation process ready after spawn (0.5B stand-in)", f"{ready:.1f} s"))
    return rows


def render_generic(section: Section) -> str:
    """For a benchmark without its own renderer yet: the scalar entries of its `summary` (or top level)."""
    data = section.first
    summary = data.get("summary", data)
    rows = [[key, value] for key, value in summary.items() if isinstance(value, int | float | str)]
    return table(["figure", "value"], rows) if rows else "(no scalar figures at the top of this file)"


Renderer = Callable[[Section], str]
Summarizer = Callable[[Section], list[Row]]
