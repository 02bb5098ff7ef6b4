"""Tool calls with real latency: TRL's `GRPOTrainer` (its own synchronous tool loop) against `AsyncGRPOTrainer`
(tools run in the generation process), side by side.

    python benchmarks/bench_tools.py                                   # 3 pairs of 120-step runs, 50 ms per tool call
    python benchmarks/bench_tools.py --pairs 1 --steps 10              # a smoke check
    python benchmarks/bench_tools.py --tool-latency-ms 200             # a slower tool (a web search, a sandbox)

The job is the TRL-docs-style script of `bench_docs_style.py` with a tool: a plain `GRPOConfig` (TRL's defaults:
gradient checkpointing on, up to 256 completion tokens, no limit on tool-calling rounds, learning rate 1e-6, logging
every 10 steps) with 32 rows a step, the bundled tools model (`trl_async.toy.tiny_tools_model_path()`), its
three-digit multiplication problems, `tools=[multiply]` and the text reward `math_answer_text_reward`. The tool is the
task's `multiply` after a documented sleep of `--tool-latency-ms` per call: the latency of a tool that waits on
something (an API, a sandbox, a database), not its computation. Only the trainer class differs between the arms.

Each run is a fresh process (this script with `--run-one`); the two runs of a pair follow each other and the order
alternates from pair to pair (sync first, then async first, ...) so that slow drifts of a shared machine hit both
alike. Cores: both arms get the same cores, started with `python` and OMP_NUM_THREADS and MKL_NUM_THREADS removed
from their environment: `GRPOTrainer` computes on every core with torch's default thread count; `AsyncGRPOTrainer`
splits them between its trainer and its generation process. The load average before and after each run is recorded.

Reported per run: the seconds of `trainer.train()` (including the generation process's start-up), the process's
wall seconds, TRL's logged reward and tool-call frequency, and the held-out greedy accuracy after training, with the
tool executed (`trl_async.toy.tools.tool_accuracy`: TRL's own multi-turn code; the evaluation's tool has no sleep),
on `--eval-problems` problems of the tools build's held-out split; the same accuracy of the untrained model once.
Summary: medians per arm and the paired ratios sync / async of training seconds (> 1: asynchronous is faster),
median [min, max]. Writes benchmarks/results/bench_tools.json (or --output).
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
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
ARMS = {
    "sync": "GRPOTrainer (TRL's synchronous tool loop)",
    "async": "AsyncGRPOTrainer (tools in the generation process)",
}
REMOVED_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs (sync + async), order alternating")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (max_steps)")
    parser.add_argument(
        "--tool-latency-ms", type=float, default=50.0, help="sleep of the tool per call, in milliseconds (default 50)"
    )
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems evaluated after each run")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (GRPOConfig.seed)")
    parser.add_argument("--output", default=os.path.join(RESULTS, "bench_tools.json"), help="the JSON results path")
    parser.add_argument("--run-one", nargs=2, metavar=("ARM", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 1 or args.eval_problems < 1 or args.tool_latency_ms < 0:
        parser.error("--pairs, --steps and --eval-problems must be >= 1, --tool-latency-ms >= 0")
    return args


# ------------------------------------------------------------------------------------------------ one run
def slow_multiply(latency_s: float):
    """The task's `multiply` after `latency_s` seconds of waiting (defined in a function: it travels to the
    generation process by value, with its latency)."""
    from trl_async.toy.tools import multiply as task_multiply

    def multiply(a: int, b: int) -> int:
        time.sleep(latency_s)  # the tool waits on something: an API, a sandbox, a database
        return task_multiply(a, b)

    multiply.__doc__ = task_multiply.__doc__
    return multiply


def held_out(eval_problems: int):
    from trl_async.toy.tools import make_multiplication_dataset

    return make_multiplication_dataset(num_train=2000, num_test=200, seed=0)["test"].select(range(eval_problems))


def evaluate(model, tokenizer, eval_problems: int) -> dict:
    import torch

    from trl_async.toy.tools import tool_accuracy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1M-parameter model: one thread is fastest (recipes/accuracy.py)
    try:
        result = tool_accuracy(model, tokenizer, held_out(eval_problems))
    finally:
        torch.set_num_threads(threads)
    return {key: result[key] for key in ("accuracy", "tool_call_rate", "well_formed_rate", "n")}


def run_one(arm: str, output_dir: str, args) -> None:
    """One training run in this (fresh) process; writes OUTPUT_DIR/result.json."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_async import AsyncGRPOTrainer
    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy.tools import make_multiplication_dataset, tiny_tools_model_path

    dataset = make_multiplication_dataset(num_train=2000, num_test=200, seed=0)["train"]
    training_args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=32,
        max_steps=args.steps,
        report_to="none",
        bf16=False,  # CPU
        seed=args.seed,
    )
    trainer_class = GRPOTrainer if arm == "sync" else AsyncGRPOTrainer
    trainer = trainer_class(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=training_args,
        train_dataset=dataset,
        tools=[slow_multiply(args.tool_latency_ms / 1000.0)],
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    model = trainer.accelerator.unwrap_model(trainer.model)
    accuracy = evaluate(model, AutoTokenizer.from_pretrained(tiny_tools_model_path()), args.eval_problems)
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump({"trainer": type(trainer).__name__, "train_s": train_s, "accuracy_after": accuracy,
                   "log_history": trainer.state.log_history}, f)  # fmt: skip


# ------------------------------------------------------------------------------------------------ the pairs
def launch(arm: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_tools_{arm}_") as out:
        env = {k: v for k, v in os.environ.items() if k not in REMOVED_VARIABLES}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=ROOT)
        command = [sys.executable, os.path.abspath(__file__), "--run-one", arm, out, "--steps", str(args.steps),
                   "--tool-latency-ms", str(args.tool_latency_ms), "--eval-problems", str(args.eval_problems),
                   "--seed", str(args.seed)]  # fmt: skip
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"the {arm} run failed:\n{proc.stderr[-4000:]}")
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
    history = result["log_history"]
    return {
        "arm": arm,
        "trainer": result["trainer"],
        "train_s": result["train_s"],
        "wall_s": wall,
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
        "rewards": [h["reward"] for h in history if "reward" in h],
        "tool_call_frequency": [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h],
        "async_last_log": next((h for h in reversed(history) if "async/staleness_mean" in h), None),
        "accuracy_after": result["accuracy_after"],
    }


def paired(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summarize(runs: list[dict], args, before: dict) -> dict:
    by_pair = {}
    for run in runs:
        by_pair.setdefault(run["pair"], {})[run["arm"]] = run
    pairs = [by_pair[p] for p in sorted(by_pair) if set(by_pair[p]) == set(ARMS)]
    ratios = [p["sync"]["train_s"] / p["async"]["train_s"] for p in pairs]

    def median(arm, key):
        return statistics.median(r[key] for r in runs if r["arm"] == arm)

    return {
        "steps": args.steps,
        "pairs": len(pairs),
        "tool_latency_ms": args.tool_latency_ms,
        "sync_train_s_median": median("sync", "train_s"),
        "async_train_s_median": median("async", "train_s"),
        "sync_wall_s_median": median("sync", "wall_s"),
        "async_wall_s_median": median("async", "wall_s"),
        "speedup_train_s_sync_over_async": paired(ratios),
        "held_out_accuracy_before": before,
        "held_out_accuracy_after_median": {
            arm: statistics.median(r["accuracy_after"]["accuracy"] for r in runs if r["arm"] == arm) for arm in ARMS
        },
    }


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.run_one:
        arm, output_dir = args.run_one
        run_one(arm, output_dir, args)
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async.toy.tools import tiny_tools_model_path

    path = tiny_tools_model_path()
    before = evaluate(
        AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), args.eval_problems
    )
    print(f"held-out accuracy before training: {before}", flush=True)
    runs = []
    for pair in range(args.pairs):
        order = ["sync", "async"] if pair % 2 == 0 else ["async", "sync"]
        for position, arm in enumerate(order):
            run = launch(arm, args)
            run.update(pair=pair, position=position)
            runs.append(run)
            print(f"pair {pair} {arm:5s}: train {run['train_s']:6.1f}s, wall {run['wall_s']:6.1f}s, held-out "
                  f"accuracy {run['accuracy_after']['accuracy']:.3f}, load {run['load_avg_1m_before']:.1f} -> "
                  f"{run['load_avg_1m_after']:.1f}", flush=True)  # fmt: skip
    summary = summarize(runs, args, before)
    result = {
        "benchmark": "bench_tools",
        "command": "python benchmarks/bench_tools.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "arms": ARMS,
        "job": "plain GRPOConfig (TRL defaults), per_device_train_batch_size=32, the bundled tools model, "
        "tools=[multiply after a sleep of --tool-latency-ms], math_answer_text_reward; only the trainer class differs",
        "environment": {"removed_from_the_environment": list(REMOVED_VARIABLES)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    ratio = summary["speedup_train_s_sync_over_async"]
    print(f"training seconds, sync / async, paired: {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}] "
          f"over {summary['pairs']} pair(s); wrote {args.output}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
