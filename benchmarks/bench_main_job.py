"""The main job, asynchronous against synchronous generation, side by side in one invocation.

    python benchmarks/bench_main_job.py                          # 3 pairs of the default job, both arms on every core
    python benchmarks/bench_main_job.py --pairs 1 --max_steps 40 # quick check
    python benchmarks/bench_main_job.py --seeds 1,2,3            # one pair per seed: the seed-to-seed spread
    python benchmarks/bench_main_job.py --regime accelerate_launch   # the same under `accelerate launch`
    python benchmarks/bench_main_job.py --regime omp_num_threads_2   # the user exported OMP_NUM_THREADS=2

Each run is the main job, `recipes/qwen_math.py` with the default (tiny) config, in a fresh process. The synchronous
run is the same command with `--async_generation false`: the same config, the same class, TRL's generation in the
training process. The two runs of a pair follow each other, and the order alternates from pair to pair (async
first, then sync first, ...) so that slow drifts of a shared machine hit both alike.

Cores (`--regime`): both arms must be given the same cores, or the ratio measures the thread settings.
* `same_cores` (default, the headline): `python recipes/qwen_math.py` with OMP_NUM_THREADS and MKL_NUM_THREADS
  removed from the environment, as a user runs it. The synchronous arm's torch uses every core; the asynchronous
  arm splits them between its trainer and its generation process (and lends a waiting process's share).
* `accelerate_launch`: `accelerate launch recipes/qwen_math.py`, OMP_NUM_THREADS removed as above. accelerate's
  launcher then exports OMP_NUM_THREADS=1 on a machine without a GPU (accelerate/commands/launch.py, unless `--cpu`
  or a thread count is given), so the synchronous arm trains and generates on one core, while the asynchronous arm
  runs its generation process on a second one. The ratio is larger than the same-cores one for that reason; it is
  what a user of `accelerate launch` on a CPU machine sees.
* `omp_num_threads_2`: `OMP_NUM_THREADS=2 python recipes/qwen_math.py`, a user who set a thread count (2 on the
  2-core machine). The synchronous arm's torch uses 2 threads; the asynchronous arm's trainer and generation process
  share that budget (issue 25's thread budget) instead of each taking it.
* `two_processes`: `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/qwen_math.py`, the
  job on two CPU ranks (each with its own generation process in the asynchronous arm). The launcher exports
  OMP_NUM_THREADS=1 to each rank, in both arms: the synchronous arm's two ranks take the two cores, the asynchronous
  arm's two trainers and two generation processes share them.

Each run records its timeline (`trl_async.timeline`): the asynchronous run's says where its time went, the
synchronous run's (the same trainer with `async_generation=False`) gives the limit of overlapping its generation with
its training, (generation + training) / max(generation, training), reported beside the measured ratio.
Before the runs, a probe started through the same launcher with the same environment records what the recipe sees
(OMP_NUM_THREADS, torch's thread count, the usable cores): `environment` in the JSON.

Recorded per run: training seconds (`trainer.train()`, from reward_summary.json), wall seconds of the whole
command, the mean reward of the first and last quarter of steps and their gain, and the held-out greedy accuracy
before and after (eval.json). Summary: medians per mode, and the paired ratios sync/async of training seconds
(> 1: asynchronous generation is faster) with their min, median and max. Writes
benchmarks/results/bench_main_job.json, a PNG of the runs beside it, and copies the first asynchronous run's
reward_accuracy.png to benchmarks/results/main_job_reward_accuracy.png (the picture RESULTS.md shows; same-cores
regime, default job only). Under `accelerate_launch` the default output is benchmarks/results/bench_main_job_accelerate.json.

Learning at equal wall time (with --seeds): each run also records its reward curve against wall-clock time
(`reward_curve`: [seconds, reward] per logged step, the seconds from its timeline's step track, which keeps the first
200 steps and then 5 in every 100: the steps between kept ones are placed linearly, the last at the end of
training), and `<out>_equal_time.png` beside the JSON shows, per mode and averaged over the seeds, the reward against
wall-clock seconds and the held-out accuracy before and after against the seconds it took to reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from run_timeline import timeline_figures  # benchmarks/run_timeline.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RECIPE = os.path.join(ROOT, "recipes", "qwen_math.py")
MODES = {"async": [], "sync": ["--async_generation", "false"]}
# How each regime starts a script: the interpreter, or accelerate's launcher (one process, as README's quick start).
LAUNCHERS = {
    "same_cores": [sys.executable],
    "accelerate_launch": [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no"],
    "omp_num_threads_2": [sys.executable],
    "two_processes": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                      "--mixed_precision", "no", "--dynamo_backend", "no"],
}  # fmt: skip
# The thread settings each regime puts in the environment (after removing the user's).
REGIME_THREADS = {"same_cores": {}, "accelerate_launch": {}, "omp_num_threads_2": {"OMP_NUM_THREADS": "2"},
                  "two_processes": {}}  # fmt: skip
# Other settings a regime puts in the environment: two CPU ranks under `accelerate launch` need ACCELERATE_USE_CPU.
REGIME_ENV = {"two_processes": {"ACCELERATE_USE_CPU": "1"}}
COMMANDS = {
    "same_cores": "python recipes/qwen_math.py",
    "accelerate_launch": "accelerate launch recipes/qwen_math.py",
    "omp_num_threads_2": "OMP_NUM_THREADS=2 python recipes/qwen_math.py",
    "two_processes": "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 recipes/qwen_math.py",
}
DEFAULT_OUT = {
    "same_cores": "bench_main_job.json",
    "accelerate_launch": "bench_main_job_accelerate.json",
    "omp_num_threads_2": "bench_main_job_omp2.json",
    "two_processes": "bench_main_job_two_processes.json",
}
# What the recipe sees, printed by a script started exactly like the recipe.
THREAD_PROBE = (
    "import json, os, torch; print(json.dumps({'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'), "
    "'MKL_NUM_THREADS': os.environ.get('MKL_NUM_THREADS'), 'torch_num_threads': torch.get_num_threads(), "
    "'usable_cores': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}))"
)


def run_env(regime: str = "same_cores") -> dict:
    """The environment of every run: the user's without thread settings, plus those the regime sets."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(REGIME_THREADS[regime])
    env.update(REGIME_ENV.get(regime, {}))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def probe_environment(regime: str) -> dict:
    """OMP_NUM_THREADS, torch's thread count and the usable cores as a script started like the recipe sees them."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(THREAD_PROBE + "\n")
    try:
        proc = subprocess.run(
            [*LAUNCHERS[regime], f.name], capture_output=True, text=True, env=run_env(regime), cwd=ROOT
        )
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"the thread probe failed under {regime}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_once(
    mode: str,
    output_dir: str,
    max_steps: int | None,
    seed: int | None = None,
    regime: str = "same_cores",
    recipe_args: tuple[str, ...] = (),
) -> dict:
    """One run of the main job in `mode`; returns its figures (raises with the run's stderr if it fails)."""
    cmd = [*LAUNCHERS[regime], RECIPE, "--output_dir", output_dir, *MODES[mode], *recipe_args]
    if max_steps is not None:
        cmd += ["--max_steps", str(max_steps)]
    if seed is not None:  # the recipe's --seed (TrainingArguments) seeds the model's sampling and its dataset split
        cmd += ["--seed", str(seed)]
    env = run_env(regime)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    summary = json.load(open(os.path.join(output_dir, "reward_summary.json")))
    timeline = timeline_figures(output_dir, sync=mode == "sync")
    history = json.load(open(os.path.join(output_dir, "trainer_state.json")))["log_history"]
    eval_path = os.path.join(output_dir, "eval.json")
    results = json.load(open(eval_path)) if os.path.exists(eval_path) else None
    return {
        "mode": mode,
        "train_seconds": summary["seconds"],
        "wall_seconds": round(wall, 1),
        "steps": summary["steps"],
        "reward_first_quarter": summary["first_quarter"],
        "reward_last_quarter": summary["last_quarter"],
        "reward_gain": summary["gain"],
        "accuracy_before": results["before"]["accuracy"] if results else None,
        "accuracy_after": results["after"]["accuracy"] if results else None,
        "eval_samples": results["num_samples"] if results else None,
        "timeline": timeline,
        "reward_curve": reward_curve(output_dir, history, summary["seconds"]),
    }


def step_end_seconds(steps: list[tuple], last_step: int, train_seconds: float) -> list[float]:
    """Seconds from the start of the trainer's step track to the end of each optimizer step 1..`last_step`, from the
    timeline's kept steps ((step counted from 0, start, end) each; None for the track before the first step). A step
    the timeline did not keep is placed linearly between the kept ones around it; after the last kept step, towards
    the end of training (`train_seconds` after the start)."""
    origin = min(start for _, start, _ in steps)
    known = {0: 0.0, **{step + 1: end - origin for step, _, end in steps if step is not None}}
    known.setdefault(last_step, max(train_seconds, max(known.values())))
    anchors = sorted((step, seconds) for step, seconds in known.items() if step <= last_step)
    out = []
    for step in range(1, last_step + 1):
        right = next(i for i, (s, _) in enumerate(anchors) if s >= step)
        (s1, t1), (s0, t0) = anchors[right], anchors[max(right - 1, 0)]
        out.append(t1 if s1 == step else t0 + (t1 - t0) * (step - s0) / (s1 - s0))
    return out


def reward_curve(output_dir: str, history: list[dict], train_seconds: float) -> list[list[float]] | None:
    """[seconds, reward] per logged step: the reward against wall-clock time (None without a timeline)."""
    from trl_async import timeline

    if not os.path.exists(os.path.join(output_dir, timeline.TIMELINE_FILE)):
        return None
    trace = timeline.load_trace(output_dir)
    trainer = next(p for p in timeline.analysis.processes(trace) if p["role"] == "trainer" and p["rank"] == 0)
    logged = [(h["step"], h["reward"]) for h in history if "reward" in h and "step" in h]
    if not logged:
        return None
    ends = step_end_seconds([(s, a, b) for s, a, b, _ in trainer["steps"]], max(s for s, _ in logged), train_seconds)
    return [[ends[step - 1], reward] for step, reward in logged]


def ratio_stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("train_seconds", "wall_seconds", "reward_gain", "accuracy_before", "accuracy_after")
            if all(r[key] is not None for r in mine)
        }
    pairs = sorted({r["pair"] for r in runs})
    by_pair = {p: {r["mode"]: r for r in runs if r["pair"] == p} for p in pairs}
    summary["speedup_train_seconds_sync_over_async"] = ratio_stats(
        [by_pair[p]["sync"]["train_seconds"] / by_pair[p]["async"]["train_seconds"] for p in pairs]
    )
    summary["speedup_wall_seconds_sync_over_async"] = ratio_stats(
        [by_pair[p]["sync"]["wall_seconds"] / by_pair[p]["async"]["wall_seconds"] for p in pairs]
    )
    if all(r["reward_gain"] is not None for r in runs):
        summary["reward_gain_async_minus_sync"] = ratio_stats(
            [by_pair[p]["async"]["reward_gain"] - by_pair[p]["sync"]["reward_gain"] for p in pairs]
        )
    limits = [
        r["timeline"]["limit"]["ideal_overlap_ratio"] for r in runs if r["timeline"] and "limit" in r["timeline"]
    ]
    if limits:  # from each synchronous run's timeline: what overlapping its generation with its training could give
        summary["limit_ideal_overlap_ratio"] = ratio_stats(limits)
    if all(r["accuracy_after"] is not None for r in runs):  # held-out greedy accuracy at the end, paired by seed
        summary["accuracy_after_async_minus_sync"] = ratio_stats(
            [by_pair[p]["async"]["accuracy_after"] - by_pair[p]["sync"]["accuracy_after"] for p in pairs]
        )
    return summary


def print_table(runs: list[dict], summary: dict) -> None:
    header = f"{'pair':>4} {'mode':>5} {'train s':>8} {'wall s':>7} {'reward q1':>9} {'q4':>6} {'gain':>7} {'acc before':>10} {'after':>6}"
    print(header)
    print("-" * len(header))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in runs:
        print(f"{r['pair']:>4} {r['mode']:>5} {r['train_seconds']:>8.1f} {r['wall_seconds']:>7.1f} "
              f"{fmt(r['reward_first_quarter'], '9.3f')} {fmt(r['reward_last_quarter'], '6.3f')} "
              f"{fmt(r['reward_gain'], '+7.3f')} {fmt(r['accuracy_before'], '10.3f')} {fmt(r['accuracy_after'], '6.3f')}")  # fmt: skip
    for mode in MODES:
        s = summary[mode]
        print(f"median {mode:>5}: training {s['train_seconds']:.1f} s, wall {s['wall_seconds']:.1f} s, reward gain "
              f"{s.get('reward_gain', float('nan')):+.3f}, accuracy {s.get('accuracy_before', float('nan')):.3f} -> "
              f"{s.get('accuracy_after', float('nan')):.3f}")  # fmt: skip
    speed = summary["speedup_train_seconds_sync_over_async"]
    print(f"training-time ratio sync/async (paired): median {speed['median']:.2f}x "
          f"(min {speed['min']:.2f}x, max {speed['max']:.2f}x over {len(speed['values'])} pairs)")  # fmt: skip


def plot(runs: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"async": "tab:blue", "sync": "tab:gray"}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        axes[0].scatter([r["pair"] for r in mine], [r["train_seconds"] for r in mine], color=colors[mode], label=mode)
        axes[1].scatter(
            [r["pair"] for r in mine], [r["reward_gain"] or 0 for r in mine], color=colors[mode], label=mode
        )
    axes[0].set(xlabel="pair", ylabel="training seconds", title="Training time of the main job")
    axes[1].set(xlabel="pair", ylabel="reward gain (last - first quarter)", title="Reward gain")
    for ax in axes:
        ax.set_xticks(sorted({r["pair"] for r in runs}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_equal_time(runs: list[dict], path: str) -> bool:
    """Per mode, averaged over the seeds: the reward (a rolling mean over 5% of the logged steps) against wall-clock
    seconds, up to the end of the mode's shortest run, ± the standard error over the seeds; and the held-out accuracy
    before training (at 0 s) and after (at the mode's median training seconds), ± the standard error. False without
    matplotlib or reward curves."""
    try:
        import matplotlib
        import numpy as np

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curves = {mode: [r["reward_curve"] for r in runs if r["mode"] == mode and r.get("reward_curve")] for mode in MODES}
    if not all(curves.values()):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"async": "tab:blue", "sync": "tab:gray"}
    done = {mode: statistics.median(r["train_seconds"] for r in runs if r["mode"] == mode) for mode in MODES}
    for mode in MODES:
        window = max(1, len(curves[mode][0]) // 20)
        smoothed = []
        for curve in curves[mode]:
            seconds, reward = np.array(curve).T
            smoothed.append((seconds, np.convolve(reward, np.ones(window) / window, mode="valid"), window))
        end = min(s[-1] for s, _, _ in smoothed)
        grid = np.linspace(max(s[window - 1] for s, _, _ in smoothed), end, 200)
        values = np.array([np.interp(grid, s[w - 1 :], r) for s, r, w in smoothed])
        mean = values.mean(axis=0)
        se = values.std(axis=0, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else np.zeros_like(mean)
        label = f"{mode} ({len(values)} seed{'s' if len(values) > 1 else ''})"
        axes[0].plot(grid, mean, color=colors[mode], label=label)
        axes[0].fill_between(grid, mean - se, mean + se, color=colors[mode], alpha=0.2)
        mine = [r for r in runs if r["mode"] == mode and r.get("accuracy_after") is not None]
        if mine:
            before = [r["accuracy_before"] for r in mine]
            after = [r["accuracy_after"] for r in mine]
            err = lambda v: statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else 0.0  # noqa: E731
            axes[1].errorbar([0.0, done[mode]], [statistics.mean(before), statistics.mean(after)],
                             yerr=[err(before), err(after)], color=colors[mode], marker="o", capsize=4,
                             label=label)  # fmt: skip
            for r in mine:
                axes[1].plot([0.0, r["train_seconds"]], [r["accuracy_before"], r["accuracy_after"]],
                             color=colors[mode], alpha=0.15, linewidth=0.8)  # fmt: skip
    for ax in axes:
        ax.axvline(done["async"], color=colors["async"], linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set(xlabel="wall-clock seconds of training", ylabel="reward (rolling mean)",
                title="Reward against wall-clock time, seed mean ± s.e.")  # fmt: skip
    axes[1].set(xlabel="wall-clock seconds of training", ylabel="held-out greedy accuracy",
                title="Accuracy reached, and when (seed mean ± s.e.)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs (async + sync), order alternating")
    parser.add_argument("--max_steps", type=int, default=None, help="shorten every run (default: the job's own)")
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, one pair per seed (replaces --pairs): how far the reward gain moves with the "
        "seed alone, to read the async-sync difference against",
    )
    parser.add_argument(
        "--regime",
        choices=sorted(LAUNCHERS),
        default="same_cores",
        help="same_cores: `python recipes/qwen_math.py`, both arms on every core (the headline); accelerate_launch: "
        "`accelerate launch recipes/qwen_math.py`, whose launcher gives the synchronous arm one core; "
        "omp_num_threads_2: `OMP_NUM_THREADS=2 python recipes/qwen_math.py`; two_processes: two CPU ranks under "
        "`accelerate launch --multi_gpu --num_processes 2` (one thread each, from the launcher, in both arms)",
    )
    parser.add_argument(
        "--recipe_args", default="", help="further recipe arguments for every run, e.g. '--eval_max_samples 50'"
    )
    parser.add_argument("--out", default=None, help="JSON results path (default: benchmarks/results/, per regime)")
    parser.add_argument("--note", default=None, help="a note on the machine's state, kept in the JSON")
    args = parser.parse_args(argv)
    args.out = args.out or os.path.join(RESULTS, DEFAULT_OUT[args.regime])
    recipe_args = tuple(shlex.split(args.recipe_args))
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None] * args.pairs
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers such as 1,2,3, not {args.seeds!r}")
    environment = probe_environment(args.regime)
    print(f"{args.regime}: the recipe sees {environment}", flush=True)
    runs, picture = [], None
    with tempfile.TemporaryDirectory(prefix="bench_main_job_") as tmp:
        for pair, seed in enumerate(seeds):
            order = ["async", "sync"] if pair % 2 == 0 else ["sync", "async"]
            for position, mode in enumerate(order):
                output_dir = os.path.join(tmp, f"pair{pair}-{mode}")
                record = run_once(mode, output_dir, args.max_steps, seed, args.regime, recipe_args)
                record.update(pair=pair, position=position, seed=seed)
                runs.append(record)
                print(f"pair {pair} {mode}: {record['train_seconds']:.1f} s training, reward gain "
                      f"{record['reward_gain']}", flush=True)  # fmt: skip
                # RESULTS.md shows the default job's picture (same cores), not a shortened one
                full_job = args.max_steps is None and args.seeds is None and not recipe_args
                full_job = full_job and args.regime == "same_cores"
                if full_job and picture is None and mode == "async":
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    picture = os.path.join(os.path.dirname(os.path.abspath(args.out)), "main_job_reward_accuracy.png")
                    shutil.copyfile(os.path.join(output_dir, "reward_accuracy.png"), picture)
    summary = summarize(runs)
    print_table(runs, summary)
    result = {
        "command": f"{COMMANDS[args.regime]} [--async_generation false]"
        + (f" --max_steps {args.max_steps}" if args.max_steps else "")
        + (" --seed S" if args.seeds else "")
        + (f" {shlex.join(recipe_args)}" if recipe_args else ""),
        "regime": args.regime,
        "environment": {
            "removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"],
            "set_by_the_regime": REGIME_THREADS[args.regime],
            "seen_by_the_recipe": environment,
        },
        "pairs": len(seeds),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": args.note,
        },
        "runs": runs,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    equal_time = os.path.splitext(args.out)[0] + "_equal_time.png"
    equal_time = equal_time if args.seeds and plot_equal_time(runs, equal_time) else None
    print(
        f"wrote {args.out}"
        + (f" and {png}" if plot(runs, png) else "")
        + (f"; picture {picture}" if picture else "")
        + (f"; learning at equal wall time: {equal_time}" if equal_time else "")
    )
    return result


if __name__ == "__main__":
    main()
