"""PPO (AsyncPPOTrainer, a learned critic) vs GRPO (AsyncGRPOTrainer, group baseline) on the bundled tiny model.

Both train on generated arithmetic with the tensor-native `MathAnswerReward`, asynchronously (max_staleness=1), on the
same number of rows per optimizer step and the same number of steps, so the curves compare them at an equal number of
rows, at the same sampling temperature (0.7, TRL's former PPO default). GRPO samples 8 completions for each of 8
prompts per step (the recipe's tiny settings: M2PO, lr 1e-4); PPO one completion for each of 64 prompts (its settings:
docs/ppo.md, "Trainer"). For each seed the two runs go back to back,
so load on a shared machine hits both alike; the wall-time ratio is reported per seed (median, min, max).

    OMP_NUM_THREADS=1 python benchmarks/bench_ppo_vs_grpo.py                # 3 seeds x 2 methods
    OMP_NUM_THREADS=1 python benchmarks/bench_ppo_vs_grpo.py --steps 40     # shorter

Writes benchmarks/results/bench_ppo_vs_grpo.json and bench_ppo_vs_grpo.png (reward vs rows, mean ± standard error
over seeds, and PPO's explained variance) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The settings of the slow test `tests/test_ppo_trainer.py::test_tiny_arithmetic_reward_and_explained_variance_rise`.
PPO_SETTINGS = dict(num_generations=1, learning_rate=1e-4, critic_learning_rate=1e-3)
# recipes/configs/tiny.yaml's GRPO settings.
GRPO_SETTINGS = dict(num_generations=8, learning_rate=1e-4, loss_type="m2po", beta=0.0)
# Both sample at TRL's former PPO temperature, so that the reward curves compare the algorithms, not the temperatures.
TEMPERATURE = 0.7


def run(method: str, seed: int, steps: int, rows_per_step: int, max_completion_length: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncPPOConfig, AsyncPPOTrainer
    from trl_async.rewards import MathAnswerReward
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    dataset = make_arithmetic_dataset(num_train=4000, num_test=8, seed=seed)["train"]
    config_cls, trainer_cls, settings = (
        (AsyncPPOConfig, AsyncPPOTrainer, PPO_SETTINGS)
        if method == "ppo"
        else (AsyncGRPOConfig, AsyncGRPOTrainer, GRPO_SETTINGS)
    )
    with tempfile.TemporaryDirectory() as output_dir:
        args = config_cls(
            output_dir=output_dir,
            max_steps=steps,
            per_device_train_batch_size=rows_per_step,
            max_completion_length=max_completion_length,
            temperature=TEMPERATURE,
            lr_scheduler_type="constant",
            max_staleness=1,
            gradient_checkpointing=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            bf16=False,
            seed=seed,
            **settings,
        )
        trainer = trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
            reward_funcs=MathAnswerReward(tokenizer),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        history = [h for h in trainer.state.log_history if "reward" in h]
        del trainer
        gc.collect()
    return {
        "method": method,
        "seed": seed,
        "seconds": seconds,
        "reward": [h["reward"] for h in history],
        "explained_variance": [h.get("ppo/explained_variance") for h in history],
        "kl": [h.get("objective/kl", h.get("kl")) for h in history],
    }


def standard_error(values: list[float]) -> float:
    """Standard error of the mean over seeds (sample standard deviation / sqrt(n)); NaN for one seed."""
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else float("nan")


def quarter_gain(curve: list[float]) -> float:
    q = max(1, len(curve) // 4)
    return float(np.mean(curve[-q:]) - np.mean(curve[:q]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows-per-step", type=int, default=64)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window of the plotted curves (steps)")
    parser.add_argument("--out", default=RESULTS, help="folder of bench_ppo_vs_grpo.json and .png")
    parser.add_argument("--note", default=None, help="a note on the machine's state, kept in the JSON")
    cli = parser.parse_args()

    runs = []
    for seed in cli.seeds:
        for method in ("grpo", "ppo"):
            result = run(method, seed, cli.steps, cli.rows_per_step, cli.max_completion_length)
            runs.append(result)
            print(f"{method} seed {seed}: {result['seconds']:.0f} s, reward gain (last - first quarter) "
                  f"{quarter_gain(result['reward']):+.3f}", flush=True)  # fmt: skip

    summary = {}
    for method in ("grpo", "ppo"):
        mine = [r for r in runs if r["method"] == method]
        gains = [quarter_gain(r["reward"]) for r in mine]
        q = max(1, cli.steps // 4)
        summary[method] = {
            "reward_first_quarter": [float(np.mean(r["reward"][:q])) for r in mine],
            "reward_last_quarter": [float(np.mean(r["reward"][-q:])) for r in mine],
            "reward_gain_mean": float(np.mean(gains)),
            "reward_gain_std": float(np.std(gains)),
            "reward_gain_standard_error": standard_error(gains),
            "seconds": [r["seconds"] for r in mine],
        }
        if method == "ppo":
            ev = [[np.nan if v is None else v for v in r["explained_variance"]] for r in mine]
            summary[method]["explained_variance_first_quarter"] = [float(np.nanmean(e[:q])) for e in ev]
            summary[method]["explained_variance_last_quarter"] = [float(np.nanmean(e[-q:])) for e in ev]
    ratios = [p["seconds"] / g["seconds"] for g, p in zip(runs[0::2], runs[1::2], strict=True)]
    summary["wall_time_ratio_ppo_over_grpo"] = {
        "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_seed": ratios,
    }  # fmt: skip

    os.makedirs(cli.out, exist_ok=True)
    record = {
        "settings": {**vars(cli), "temperature": TEMPERATURE},
        "ppo": PPO_SETTINGS,
        "grpo": GRPO_SETTINGS,
        "summary": summary,
        "runs": runs,
        "note": cli.note,
    }
    with open(os.path.join(cli.out, "bench_ppo_vs_grpo.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(runs, cli, os.path.join(cli.out, "bench_ppo_vs_grpo.png"))

    print(f"\n{'method':<6} {'first quarter':>14} {'last quarter':>13} {'gain (mean ± s.e.)':>19} {'seconds':>9}")
    for method in ("grpo", "ppo"):
        s = summary[method]
        print(f"{method:<6} {np.mean(s['reward_first_quarter']):>14.3f} {np.mean(s['reward_last_quarter']):>13.3f} "
              f"{s['reward_gain_mean']:>+11.3f} ± {s['reward_gain_standard_error']:.3f} {np.median(s['seconds']):>9.0f}")  # fmt: skip
    ev = summary["ppo"]
    print(f"ppo explained variance: first quarter {np.mean(ev['explained_variance_first_quarter']):.3f}, last "
          f"quarter {np.mean(ev['explained_variance_last_quarter']):.3f}")  # fmt: skip
    r = summary["wall_time_ratio_ppo_over_grpo"]
    print(f"wall time PPO / GRPO per seed: median {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f})")


def _smooth(curve: np.ndarray, window: int) -> np.ndarray:
    if window <= 1:
        return curve
    kernel = np.ones(window) / window
    padded = np.pad(curve, (window - 1, 0), mode="edge")  # trailing average: step n uses steps n-window+1 .. n
    return np.convolve(padded, kernel, mode="valid")


def plot(runs: list[dict], cli, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, color, label in (
        ("grpo", "tab:blue", "GRPO (8 prompts × 8, M2PO)"),
        ("ppo", "tab:red", "PPO (64 prompts × 1, critic)"),
    ):
        curves = np.array([_smooth(np.array(r["reward"]), cli.smooth) for r in runs if r["method"] == method])
        rows = np.arange(1, curves.shape[1] + 1) * cli.rows_per_step
        mean, se = curves.mean(axis=0), curves.std(axis=0, ddof=1) / np.sqrt(len(curves))
        left.plot(rows, mean, color=color, label=label)
        left.fill_between(rows, mean - se, mean + se, color=color, alpha=0.2)
    left.set_xlabel("rows trained on")
    left.set_ylabel(f"reward (moving average over {cli.smooth} steps)")
    left.set_title(f"Tiny model, arithmetic: mean ± standard error over {len(cli.seeds)} seeds")
    left.legend()
    ev = np.array(
        [_smooth(np.array(r["explained_variance"], dtype=float), cli.smooth) for r in runs if r["method"] == "ppo"]
    )
    rows = np.arange(1, ev.shape[1] + 1) * cli.rows_per_step
    ev_se = ev.std(axis=0, ddof=1) / np.sqrt(len(ev))
    right.plot(rows, ev.mean(axis=0), color="tab:red")
    right.fill_between(rows, ev.mean(axis=0) - ev_se, ev.mean(axis=0) + ev_se, color="tab:red", alpha=0.2)
    right.axhline(0.3, color="gray", linestyle="--", linewidth=0.8)
    right.set_xlabel("rows trained on")
    right.set_ylabel("ppo/explained_variance")
    right.set_title("PPO critic: explained variance of the returns")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
