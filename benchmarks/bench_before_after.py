"""Is a change slower? The same user jobs on two checkouts of trl_async, in alternating pairs on one machine.

    python benchmarks/bench_before_after.py --before /path/to/old/checkout --pairs 3
    python benchmarks/bench_before_after.py --before /path/to/old --after /path/to/new --jobs docs_style

Jobs (each one fresh process per run, OMP_NUM_THREADS and MKL_NUM_THREADS removed so both sides get every core):

* `docs_style`: `benchmarks/docs_style_grpo.py async` (a TRL-docs-style script with `AsyncGRPOTrainer`, plain
  `GRPOConfig`, 120 steps), this checkout's script for both sides; only the `trl_async` imported differs
  (`PYTHONPATH`);
* `main_job`: each side's own `python recipes/qwen_math.py --eval_accuracy false --plot false` (the tiny job, 240
  steps), its training seconds from `reward_summary.json`.

Reports per job the paired ratio before/after of `trainer.train()` seconds (> 1: the new code is faster), median
[min, max], and writes benchmarks/results/bench_before_after.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def _env(checkout: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.path.abspath(checkout))
    return env


def _run(cmd: list[str], checkout: str, cwd: str) -> None:
    proc = subprocess.run(cmd, env=_env(checkout), cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({checkout}):\n{proc.stderr[-4000:]}")


def docs_style(checkout: str, data_file: str, model_path: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(HERE, "docs_style_grpo.py")
        _run([sys.executable, script, "async", model_path, data_file, out, str(steps)], checkout, out)
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)["train_s"]


def main_job(checkout: str, steps: int | None) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(checkout, "recipes", "qwen_math.py"), "--output_dir", out,
               "--eval_accuracy", "false", "--plot", "false"]  # fmt: skip
        if steps:
            cmd += ["--max_steps", str(steps)]
        _run(cmd, checkout, checkout)
        with open(os.path.join(out, "reward_summary.json")) as f:
            return json.load(f)["seconds"]


def git_commit(checkout: str) -> str | None:
    """The checkout's commit (None outside git), so the results name the code they compared."""
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return proc.stdout.strip() or None


def paired(before: list[float], after: list[float]) -> dict:
    ratios = [b / a for b, a in zip(before, after, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_pair": ratios,
            "before_s": before, "after_s": after}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="checkout of the code before the change")
    parser.add_argument("--after", default=ROOT, help="checkout of the code after it (default: this one)")
    parser.add_argument("--jobs", default="docs_style,main_job")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--docs-style-steps", type=int, default=120)
    parser.add_argument("--main-job-steps", type=int, default=None, help="default: the tiny config's 240")
    parser.add_argument("--output", default=os.path.join(RESULTS, "bench_before_after.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.after))
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    report = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after), "pairs": args.pairs,
              "commits": {"before": git_commit(args.before), "after": git_commit(args.after)},
              "environment": {"removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"]}, "jobs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "prompts.jsonl")
        make_arithmetic_dataset(num_train=2000, num_test=8, seed=0)["train"].to_json(data_file)
        for job in args.jobs.split(","):
            times = {"before": [], "after": []}
            for pair in range(args.pairs):
                order = ("before", "after") if pair % 2 == 0 else ("after", "before")  # alternate who goes first
                for side in order:
                    checkout = args.before if side == "before" else args.after
                    if job == "docs_style":
                        seconds = docs_style(checkout, data_file, tiny_model_path(), args.docs_style_steps)
                    else:
                        seconds = main_job(checkout, args.main_job_steps)
                    times[side].append(seconds)
                    print(f"{job} pair {pair} {side:6s} {seconds:6.1f}s", flush=True)
            report["jobs"][job] = paired(times["before"], times["after"])
            r = report["jobs"][job]
            print(f"{job}: before/after {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
