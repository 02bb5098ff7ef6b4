"""Which importance-correction mode should asynchronous runs default to? Data, not TRL's vLLM-drift tuning.

    python benchmarks/bench_is_modes.py                 # 3 modes x max_staleness 1, 2, 4 x 3 seeds, 80 steps each
    python benchmarks/bench_is_modes.py --quick         # 1 seed, 20 steps
    python benchmarks/bench_is_modes.py --learning-rate 1e-4 --steps 100 --tag _lr1e-4   # what run_all runs

TRL tuned `vllm_importance_sampling_mode="sequence_mask"` with C=3 for the small numerical drift between vLLM and the
trainer. Asynchronous rows differ by one to four optimizer steps of policy lag, a larger shift. For each mode
(`sequence_mask`, `token_truncate`, `sequence_truncate`, TRL's default clip bounds) and each `max_staleness`, the
bundled tiny model trains on generated arithmetic with `loss_type="dapo"` (TRL's default) and a learning rate high
enough that stale rows really are off-policy. Reported per (mode, staleness), mean ± standard error over seeds: the
reward of the last quarter of steps, the fraction of weights the truncation changed (zeroed or clamped), and the mean
staleness reached. Each run is a fresh process. Writes benchmarks/results/bench_is_modes{tag}.json (or --output) and
a PNG of the learning curves beside it.
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
RESULTS = os.path.join(HERE, "results")
MODES = ("sequence_mask", "token_truncate", "sequence_truncate")


def run_worker(config: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    args = AsyncGRPOConfig(
        output_dir=config["output_dir"],
        max_steps=config["steps"],
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=32,
        learning_rate=config["learning_rate"],
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=config["seed"],
        loss_type="dapo",
        max_staleness=config["max_staleness"],
        vllm_importance_sampling_mode=config["mode"],
        trainer_generates_while_starting=False,  # every row comes from the generation process, at real staleness
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    trainer = AsyncGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=math_answer_text_reward,
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=2000, seed=config["seed"])["train"],
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "reward": [h["reward"] for h in logs],
        "clipped_fraction": [h.get("sampling/importance_sampling_ratio/clipped_fraction", 0.0) for h in logs],
        "staleness_mean": [h.get("async/staleness_mean", 0.0) for h in logs],
    }


def spawn(config: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.path.dirname(HERE))
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config), "--out", out.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"run failed:\n{proc.stderr[-4000:]}")
        return json.load(open(out.name))


def mean_se(values):
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--staleness", default="1,2,4")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the output files, e.g. _lr1e-4")
    parser.add_argument(
        "--output", default=None, help="JSON path (default benchmarks/results/bench_is_modes{tag}.json)"
    )
    args = parser.parse_args()
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(run_worker(json.loads(args.worker)), f)
        return
    if args.quick:
        args.seeds, args.steps = 1, 20
    results = {}
    for seed in range(args.seeds):
        for staleness in [int(s) for s in args.staleness.split(",")]:
            for mode in MODES:
                config = {"mode": mode, "max_staleness": staleness, "seed": seed, "steps": args.steps,
                          "learning_rate": args.learning_rate, "output_dir": tempfile.mkdtemp()}  # fmt: skip
                run = spawn(config)
                results.setdefault(f"{mode}/S{staleness}", []).append(run)
                quarter = max(1, len(run["reward"]) // 4)
                print(f"seed {seed} S={staleness} {mode:18s} reward(last q) {statistics.mean(run['reward'][-quarter:]):.3f}"
                      f"  clipped {statistics.mean(run['clipped_fraction']):.2%}", flush=True)  # fmt: skip
    table = {}
    for key, runs in results.items():
        quarter = max(1, args.steps // 4)
        table[key] = {
            "reward_last_quarter": mean_se([statistics.mean(r["reward"][-quarter:]) for r in runs]),
            "clipped_fraction": mean_se([statistics.mean(r["clipped_fraction"]) for r in runs]),
            "staleness_mean": mean_se([statistics.mean(r["staleness_mean"]) for r in runs]),
        }
    print(f"\n{'mode/staleness':26s} {'reward last q':>16s} {'clipped':>16s} {'staleness':>10s}")
    for key, row in table.items():
        (r, rse), (c, cse), (st, _) = row["reward_last_quarter"], row["clipped_fraction"], row["staleness_mean"]
        print(f"{key:26s} {r:7.3f} ± {rse:.3f} {c:8.2%} ± {cse:.2%} {st:10.2f}")
    output = args.output or os.path.join(RESULTS, f"bench_is_modes{args.tag}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"steps": args.steps, "seeds": args.seeds, "learning_rate": args.learning_rate, "table": table,
                   "runs": results}, f, indent=1)  # fmt: skip
    plot(results, args.steps, path=os.path.splitext(output)[0] + ".png")


def plot(results, steps, window=10, path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stalenesses = sorted({key.split("/S")[1] for key in results}, key=int)
    fig, axes = plt.subplots(1, len(stalenesses), figsize=(4 * len(stalenesses), 3.5), sharey=True, squeeze=False)
    for ax, staleness in zip(axes[0], stalenesses, strict=True):
        for index, mode in enumerate(MODES):
            runs = results.get(f"{mode}/S{staleness}", [])
            if not runs:
                continue
            n = min(len(r["reward"]) for r in runs)
            mean = [statistics.mean(r["reward"][k] for r in runs) for k in range(n)]
            smooth = [statistics.mean(mean[max(0, k - window + 1) : k + 1]) for k in range(n)]
            ax.plot(range(1, n + 1), smooth, color=f"C{index}", label=mode)
        ax.set_title(f"max_staleness={staleness}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(f"reward (rolling mean of {window})")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path or os.path.join(RESULTS, "bench_is_modes.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
