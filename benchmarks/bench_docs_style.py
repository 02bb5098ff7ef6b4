"""Where users are: a TRL-docs-style GRPO script, run with GRPOTrainer and with AsyncGRPOTrainer, side by side.

    python benchmarks/bench_docs_style.py                  # 3 alternating pairs of 120-step runs
    python benchmarks/bench_docs_style.py --pairs 1 --steps 30     # a quick check
    python benchmarks/bench_docs_style.py --seeds 0,1,2,3,4,5,6,7,8,9   # learning: one pair per seed (~12 min)

`benchmarks/docs_style_grpo.py` is the script: a plain `GRPOConfig` (TRL's defaults: gradient checkpointing on,
free-length completions up to 512 tokens, logging every 10 steps) with 32 rows a step, the bundled tiny model, a text
reward, and no thread settings (OMP_NUM_THREADS is removed from the runs' environment). Each run is a fresh process;
the two trainers alternate (trl, async, trl, async, ...) so machine noise hits both alike. Reported: the seconds of
`trainer.train()` (which includes the generation process's start-up for the async trainer) and process wall time,
the median of each, and the paired ratios (sync seconds / async seconds per pair: median, min, max); the held-out
greedy accuracy of each run (200 arithmetic problems, never trained on) and its async - sync difference per pair.

**The limit.** Before the pairs, one run of `AsyncGRPOTrainer` with `async_generation=False` (TRL's synchronous loop,
with the run's timeline recorded) gives what overlapping generation with training could give at most
(`trl_async.timeline.sync_limit`): (generation + training) / max(generation, training), and on CPU the same bounded
by the cores the two stages keep busy where the spans carry CPU time, and the fraction of core-seconds the run keeps
busy. Each asynchronous run's timeline gives where its time went (busy fractions,
overlap, idle causes, the generation process's start-up), recorded in the results.

Cores: both trainers get the same cores. Each run is `python benchmarks/docs_style_grpo.py` with OMP_NUM_THREADS and
MKL_NUM_THREADS removed (no launcher that sets them): GRPOTrainer computes on every core with torch's default thread
count; AsyncGRPOTrainer splits the same cores between its trainer and its generation process.
**Over seeds** (`--seeds 0,1,...`): one pair per seed, the seed passed to the script's `GRPOConfig(seed=...)` in both
arms (the order alternating from seed to seed as from pair to pair), no limit run. What it is for: the held-out
accuracy of `AsyncGRPOTrainer` minus `GRPOTrainer`'s, paired by seed, as mean ± standard error and a 95% interval
(Student's t) over the seeds; RESULTS.md renders it in its own section.

Writes benchmarks/results/bench_docs_style.json, or with --seeds benchmarks/results/bench_docs_style_seeds.json (or
--output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import render_results as R  # benchmarks/render_results.py, beside this script: the figures RESULTS.md shows
from run_timeline import timeline_figures  # benchmarks/run_timeline.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def one_run(
    trainer: str,
    model_path: str,
    data_file: str,
    steps: int,
    held_out_file: str | None = None,
    seed: int | None = None,
) -> dict:
    """One fresh process of `docs_style_grpo.py`: its training seconds, wall seconds, rewards, held-out accuracy and,
    where it recorded one, its timeline's figures (`trl_async.timeline.summarize`; `sync_limit` for `limit`)."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.path.dirname(HERE))
        command = [sys.executable, os.path.join(HERE, "docs_style_grpo.py"), trainer, model_path, data_file, out,
                   str(steps), *([held_out_file or ""] if held_out_file or seed is not None else []),
                   *([str(seed)] if seed is not None else [])]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{trainer} run failed:\n{proc.stderr[-4000:]}")
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
        timeline = timeline_figures(out, sync=trainer == "limit")
    rewards = [h["reward"] for h in result["log_history"] if "reward" in h]
    last = [h for h in result["log_history"] if "async/staleness_mean" in h]
    return {
        "trainer": trainer,
        "train_s": result["train_s"],
        "wall_s": wall,
        "held_out_accuracy": result.get("held_out_accuracy"),
        "seed": result.get("seed"),
        "rewards": rewards,
        "async_last_log": last[-1] if last else None,
        "timeline": timeline,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, one pair per seed (replaces --pairs; "
                        "no limit run): held-out accuracy, AsyncGRPOTrainer - GRPOTrainer, over seeds")  # fmt: skip
    parser.add_argument("--output", default=None, help="default: benchmarks/results/bench_docs_style.json, with "
                        "--seeds bench_docs_style_seeds.json")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None] * args.pairs
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers such as 0,1,2, not {args.seeds!r}")
    args.pairs = len(seeds)
    args.output = args.output or os.path.join(RESULTS, "bench_docs_style_seeds.json" if args.seeds else
                                              "bench_docs_style.json")  # fmt: skip

    sys.path.insert(0, os.path.dirname(HERE))
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data_file, held_out_file = os.path.join(tmp, "prompts.jsonl"), os.path.join(tmp, "held_out.jsonl")
        splits = make_arithmetic_dataset(num_train=2000, num_test=200, seed=0)
        splits["train"].to_json(data_file)
        splits["test"].to_json(held_out_file)
        limit_run = limit = None
        if not args.seeds:  # the limit is about time; the seeds study is about learning
            limit_run = one_run("limit", tiny_model_path(), data_file, args.steps)
            limit = limit_run["timeline"]["limit"]
            print(f"limit (from a synchronous run's timeline): ideal {limit['ideal_overlap_ratio']:.2f}x; "
                  f"core-seconds busy {limit.get('core_busy_fraction', float('nan')):.0%}", flush=True)  # fmt: skip
        for pair, seed in enumerate(seeds):
            for trainer in ("trl", "async") if pair % 2 == 0 else ("async", "trl"):
                run = one_run(trainer, tiny_model_path(), data_file, args.steps, held_out_file, seed)
                run["pair"] = pair
                runs.append(run)
                print(f"pair {pair} {trainer:5s} seed {run['seed']} train {run['train_s']:6.1f}s  wall "
                      f"{run['wall_s']:6.1f}s  held-out {run['held_out_accuracy']:.3f}", flush=True)  # fmt: skip

    def median(trainer, key):
        return statistics.median(r[key] for r in runs if r["trainer"] == trainer)

    ratios = [
        next(r for r in runs if r["pair"] == p and r["trainer"] == "trl")["train_s"]
        / next(r for r in runs if r["pair"] == p and r["trainer"] == "async")["train_s"]
        for p in range(args.pairs)
    ]
    accuracy_gaps = [
        next(r for r in runs if r["pair"] == p and r["trainer"] == "async")["held_out_accuracy"]
        - next(r for r in runs if r["pair"] == p and r["trainer"] == "trl")["held_out_accuracy"]
        for p in range(args.pairs)
    ]
    summary = {
        "steps": args.steps,
        "seeds": seeds if args.seeds else None,
        "limit": limit,
        "held_out_accuracy_async_minus_sync_per_pair": accuracy_gaps,
        "held_out_accuracy_async_minus_sync_mean": statistics.mean(accuracy_gaps),
        "pairs": args.pairs,
        "trl_train_s_median": median("trl", "train_s"),
        "async_train_s_median": median("async", "train_s"),
        "trl_wall_s_median": median("trl", "wall_s"),
        "async_wall_s_median": median("async", "wall_s"),
        "speedup_paired_median": statistics.median(ratios),
        "speedup_paired_min": min(ratios),
        "speedup_paired_max": max(ratios),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "environment": {"removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"]},
    }
    print(json.dumps(summary, indent=2))
    if args.seeds:
        print(R.docs_style_seeds_text({"runs": runs}))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        command = f"python benchmarks/bench_docs_style.py --steps {args.steps} " + (
            f"--seeds {args.seeds}" if args.seeds else f"--pairs {args.pairs}"
        )
        json.dump({"command": command, "summary": summary, "limit_run": limit_run, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
