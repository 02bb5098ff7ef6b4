"""Where users are: a TRL-docs-style GRPO script, run with GRPOTrainer and with AsyncGRPOTrainer, side by side.

    python benchmarks/bench_docs_style.py                  # 3 alternating pairs of 120-step runs
    python benchmarks/bench_docs_style.py --pairs 1 --steps 30     # a quick check

`benchmarks/docs_style_grpo.py` is the script: a plain `GRPOConfig` (TRL's defaults: gradient checkpointing on,
free-length completions up to 512 tokens, logging every 10 steps) with 32 rows a step, the bundled tiny model, a text
reward, and no thread settings (OMP_NUM_THREADS is removed from the runs' environment). Each run is a fresh process;
the two trainers alternate (trl, async, trl, async, ...) so machine noise hits both alike. Reported: the seconds of
`trainer.train()` (which includes the generation process's start-up for the async trainer) and process wall time,
the median of each, and the paired ratios (sync seconds / async seconds per pair: median, min, max).

Cores: both trainers get the same cores. Each run is `python benchmarks/docs_style_grpo.py` with OMP_NUM_THREADS and
MKL_NUM_THREADS removed (no launcher that sets them): GRPOTrainer computes on every core with torch's default thread
count; AsyncGRPOTrainer splits the same cores between its trainer and its generation process.
Writes benchmarks/results/bench_docs_style.json (or --output).
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

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def one_run(trainer: str, model_path: str, data_file: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.path.dirname(HERE))
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "docs_style_grpo.py"), trainer, model_path, data_file, out, str(steps)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{trainer} run failed:\n{proc.stderr[-4000:]}")
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
    rewards = [h["reward"] for h in result["log_history"] if "reward" in h]
    last = [h for h in result["log_history"] if "async/staleness_mean" in h]
    return {
        "trainer": trainer,
        "train_s": result["train_s"],
        "wall_s": wall,
        "rewards": rewards,
        "async_last_log": last[-1] if last else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--output", default=os.path.join(RESULTS, "bench_docs_style.json"))
    args = parser.parse_args(argv)

    sys.path.insert(0, os.path.dirname(HERE))
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "prompts.jsonl")
        make_arithmetic_dataset(num_train=2000, num_test=8, seed=0)["train"].to_json(data_file)
        for pair in range(args.pairs):
            for trainer in ("trl", "async"):
                run = one_run(trainer, tiny_model_path(), data_file, args.steps)
                run["pair"] = pair
                runs.append(run)
                print(f"pair {pair} {trainer:5s} train {run['train_s']:6.1f}s  wall {run['wall_s']:6.1f}s", flush=True)

    def median(trainer, key):
        return statistics.median(r[key] for r in runs if r["trainer"] == trainer)

    ratios = [
        next(r for r in runs if r["pair"] == p and r["trainer"] == "trl")["train_s"]
        / next(r for r in runs if r["pair"] == p and r["trainer"] == "async")["train_s"]
        for p in range(args.pairs)
    ]
    summary = {
        "steps": args.steps,
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
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
