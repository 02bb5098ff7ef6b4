"""How stale can a rollout be? Learning at a fixed staleness k, per loss, on the tiny job.

    python benchmarks/bench_staleness.py                  # the grid below, 3 seeds, resumable (skips finished cells)
    python benchmarks/bench_staleness.py --report-only    # tables and PNGs from the results file
    python benchmarks/bench_staleness.py --contenders m2po_paper --k 8 --seeds 0   # one cell

Regime (named in every table and figure): the bundled tiny Qwen2-architecture model (1M parameters), generated
two-digit arithmetic (`recipes/configs/tiny.yaml`: 64 rows a step = 8 prompts x 8 completions, 48 tokens,
learning rate 1e-4 constant, 240 steps, the tensor-native answer reward), 2 CPU cores. PPO uses
`recipes/configs/tiny_ppo.yaml` (1 completion per prompt, a learned critic, 150 steps).

Each cell is one run of the recipe (`python recipes/qwen_math.py`, a fresh process) with `fixed_staleness=k` and
`lend_idle_cores=false` (fixed thread counts, so that a cell's floating-point sums, hence its samples, do not depend
on the machine's timing: a cell reruns to the same figures on the same CPU type): every
generation batch is generated with exactly the weights k versions before the version that trains on it (the first k
batches with the initial weights), whatever the timing, so a cell is reproducible and k is what the rows really are.
Contenders (TRL's defaults otherwise):

* `dapo_is`: `loss_type="dapo"` (TRL's default loss) with TRL's importance correction against μ (default mode,
  `sequence_mask`, C = 3);
* `dapo_no_is`: the same without the correction (`vllm_importance_sampling_correction=False`);
* `m2po_paper`: `loss_type="m2po"`, Algorithm 1 of Zheng et al. 2025 (τ = 0.04);
* `m2po_all_tokens`: M2PO with every token a candidate (AReaL's rule);
* `ppo`: `AsyncPPOTrainer` (PPO-clip with the truncated π_old/μ weight, a learned critic), at k in {0, 2, 8}.

Per cell: held-out greedy accuracy after training (500 problems, the recipe's eval), the mean reward of the last
quarter of steps, the variance of the gradient norm over steps after the pipeline filled, and the means of the
`offpolicy/*` diagnostics after the fill. Tables give mean ± standard error over seeds with the seed count.
Writes benchmarks/results/bench_staleness.json (one entry per cell, written as each finishes) and
bench_staleness_accuracy.png, bench_staleness_reward_k{0,8,32}.png.
"""

from __future__ import annotations

import argparse
import json
import math
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
RECIPE = os.path.join(ROOT, "recipes", "qwen_math.py")
CONFIGS = os.path.join(ROOT, "recipes", "configs")

CONTENDERS = {
    "dapo_is": dict(config="tiny.yaml", args=["--loss_type", "dapo"]),
    "dapo_no_is": dict(
        config="tiny.yaml", args=["--loss_type", "dapo", "--vllm_importance_sampling_correction", "false"]
    ),
    "m2po_paper": dict(config="tiny.yaml", args=["--loss_type", "m2po", "--m2po_rule", "paper"]),
    "m2po_all_tokens": dict(config="tiny.yaml", args=["--loss_type", "m2po", "--m2po_rule", "all_tokens"]),
    "ppo": dict(config="tiny_ppo.yaml", args=[]),
}
GRPO_K = (0, 1, 2, 4, 8, 16, 32)
PPO_K = (0, 2, 8)
SEEDS = (0, 1, 2)
OFFPOLICY_KEYS = (
    "offpolicy/ess",
    "offpolicy/delta_sq_before",
    "offpolicy/delta_sq_after",
    "offpolicy/masked_fraction",
    "offpolicy/clipped_fraction",
    "offpolicy/sequence_masked_fraction",
    "offpolicy/row_age_mean",
)
REGIME = (
    "bundled tiny Qwen2-architecture model (1M parameters), generated two-digit arithmetic, 2 CPU cores; "
    "recipes/configs/tiny.yaml (GRPO/M2PO: 240 steps, lr 1e-4) and tiny_ppo.yaml (PPO: 150 steps)"
)


def cell_key(contender: str, k: int, seed: int) -> str:
    return f"{contender}/k={k}/seed={seed}"


def grid(contenders, ks, seeds) -> list[tuple[str, int, int]]:
    cells = []
    for seed in seeds:  # seed-major: a partial sweep already has every contender and k at the first seed
        for k in ks:
            for contender in contenders:
                if contender == "ppo" and k not in PPO_K:
                    continue
                cells.append((contender, k, seed))
    return cells


def command(contender: str, k: int, seed: int, output_dir: str, steps: int | None) -> list[str]:
    spec = CONTENDERS[contender]
    cmd = [sys.executable, RECIPE, "--config", os.path.join(CONFIGS, spec["config"]), *spec["args"],
           "--fixed_staleness", str(k), "--max_staleness", str(k), "--seed", str(seed), "--lend_idle_cores", "false",
           "--output_dir", output_dir, "--plot", "false"]  # fmt: skip
    if steps is not None:
        cmd += ["--max_steps", str(steps)]
    return cmd


def summarize_run(output_dir: str, k: int) -> dict:
    """The cell's figures from the recipe's eval.json and trainer_state.json."""
    with open(os.path.join(output_dir, "eval.json")) as f:
        evaluation = json.load(f)
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = [h for h in json.load(f)["log_history"] if "reward" in h]
    steps = len(history)
    rewards = [h["reward"] for h in history]
    quarter = max(1, steps // 4)
    filled = [h for h in history if h["step"] > k] or history  # after the first k steps the rows are k old
    grad_norms = [h["grad_norm"] for h in filled if h.get("grad_norm") is not None]
    out = {
        "accuracy_after": evaluation["after"]["accuracy"],
        "accuracy_before": evaluation["before"]["accuracy"],
        "eval_samples": evaluation["num_samples"],
        "last_quarter_reward": statistics.fmean(rewards[-quarter:]),
        "first_quarter_reward": statistics.fmean(rewards[:quarter]),
        "grad_norm_variance": statistics.pvariance(grad_norms) if len(grad_norms) > 1 else None,
        "grad_norm_mean": statistics.fmean(grad_norms) if grad_norms else None,
        "steps": steps,
        "reward_curve": rewards,
        "evicted": sum(h.get("async/evicted", 0.0) for h in history),
    }
    for key in OFFPOLICY_KEYS:
        values = [h[key] for h in filled if key in h]
        out[key] = statistics.fmean(values) if values else None
    masked = [h["m2po/masked_fraction"] for h in filled if "m2po/masked_fraction" in h]
    out["m2po/masked_fraction"] = statistics.fmean(masked) if masked else None
    return out


def machine() -> dict:
    import torch
    import transformers
    import trl

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "trl": trl.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}  # fmt: skip


def load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"regime": REGIME, "cells": {}}


def save(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def run_sweep(args) -> None:
    results = load(args.out)
    results["regime"] = REGIME
    results.setdefault("machine", machine())
    cells = grid(args.contenders, args.k, args.seeds)
    todo = [c for c in cells if cell_key(*c) not in results["cells"]]
    print(f"[bench_staleness] {len(cells) - len(todo)} of {len(cells)} cells done; running {len(todo)}", flush=True)
    for contender, k, seed in todo:
        while args.pause_file and os.path.exists(args.pause_file):  # someone needs a quiet machine: wait between cells
            time.sleep(10)
        with tempfile.TemporaryDirectory(prefix="bench_staleness-") as output_dir:
            cmd = command(contender, k, seed, output_dir, args.steps)
            started = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            seconds = time.time() - started
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
                raise SystemExit(f"[bench_staleness] {cell_key(contender, k, seed)} failed: {' '.join(cmd)}")
            cell = summarize_run(output_dir, k)
        cell.update(contender=contender, k=k, seed=seed, seconds=round(seconds, 1),
                    command=" ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:]))  # fmt: skip
        results["cells"][cell_key(contender, k, seed)] = cell
        save(args.out, results)
        print(f"[bench_staleness] {cell_key(contender, k, seed)}: accuracy {cell['accuracy_after']:.3f}, last-quarter "
              f"reward {cell['last_quarter_reward']:.3f}, {seconds:.0f}s", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------------- report
def mean_se(values: list[float]) -> tuple[float, float | None]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return mean, se


def fmt(values: list, digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    mean, se = mean_se(values)
    return f"{mean:.{digits}f}" if se is None else f"{mean:.{digits}f} ± {se:.{digits}f}"


def by_cell(results: dict) -> dict[tuple[str, int], list[dict]]:
    table: dict[tuple[str, int], list[dict]] = {}
    for cell in results["cells"].values():
        table.setdefault((cell["contender"], cell["k"]), []).append(cell)
    return table


def report(results: dict) -> str:
    """Markdown tables: mean ± standard error over seeds (n = seeds per cell)."""
    table = by_cell(results)
    contenders = [c for c in CONTENDERS if any(key[0] == c for key in table)]
    ks = sorted({key[1] for key in table})
    lines = [f"Regime: {results['regime']}. Mean ± standard error over seeds; n = seeds in the cell.", ""]
    for title, field, digits in (
        ("Held-out greedy accuracy after training (500 problems)", "accuracy_after", 3),
        ("Mean reward, last quarter of steps", "last_quarter_reward", 3),
        ("Variance of the gradient norm over steps (after the first k)", "grad_norm_variance", 4),
        ("E[δ²] before the loss's treatment (offpolicy/delta_sq_before, after the first k steps)",
         "offpolicy/delta_sq_before", 4),
        ("Normalized ESS of π/μ per batch (offpolicy/ess)", "offpolicy/ess", 3),
        ("Tokens masked (offpolicy/masked_fraction)", "offpolicy/masked_fraction", 4),
    ):  # fmt: skip
        lines += [f"**{title}**", "", "| contender | " + " | ".join(f"k={k}" for k in ks) + " |",
                  "|---|" + "---|" * len(ks)]  # fmt: skip
        for contender in contenders:
            row = []
            for k in ks:
                cells = table.get((contender, k), [])
                row.append(f"{fmt([c[field] for c in cells], digits)} (n={len(cells)})" if cells else "")
            lines.append(f"| `{contender}` | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out_prefix: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    table = by_cell(results)
    contenders = [c for c in CONTENDERS if any(key[0] == c for key in table)]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for contender in contenders:
        ks = sorted(k for (c, k) in table if c == contender)
        stats = [mean_se([cell["accuracy_after"] for cell in table[(contender, k)]]) for k in ks]
        xs = [max(k, 0.5) for k in ks]  # k = 0 drawn at 0.5 on the log axis
        ax.errorbar(xs, [m for m, _ in stats], yerr=[se or 0.0 for _, se in stats], marker="o", capsize=3,
                    label=contender)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fixed staleness k (k=0 drawn at 0.5)")
    ax.set_ylabel("held-out greedy accuracy after training")
    ax.set_title("Accuracy vs staleness (tiny model, arithmetic, 2 CPU cores)\nmean ± s.e. over seeds", fontsize=9)
    ax.legend(fontsize=8)
    path = f"{out_prefix}_accuracy.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for k in (0, 8, 32):
        present = [c for c in contenders if (c, k) in table]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for contender in present:
            curves = [cell["reward_curve"] for cell in table[(contender, k)]]
            length = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
            window = 10  # a moving average over 10 steps, for legibility
            smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(length)]
            ax.plot(range(1, length + 1), smooth, label=f"{contender} (n={len(curves)})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean reward (10-step moving average, mean over seeds)")
        ax.set_title(f"Reward at staleness k={k} (tiny model, arithmetic, 2 CPU cores)", fontsize=9)
        ax.legend(fontsize=8)
        path = f"{out_prefix}_reward_k{k}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--k", default=",".join(map(str, GRPO_K)), help="staleness values (PPO: only 0, 2, 8)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--steps", type=int, default=None, help="override the configs' max_steps (not for figures)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "bench_staleness.json"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--pause-file", help="while this file exists, wait before starting the next cell")
    args = parser.parse_args(argv)
    args.contenders = args.contenders.split(",")
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {list(CONTENDERS)}")
    args.k = [int(k) for k in args.k.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        run_sweep(args)
    results = load(args.out)
    if results["cells"]:
        print(report(results))
        for path in plot(results, os.path.splitext(args.out)[0]):
            print(f"[bench_staleness] wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
