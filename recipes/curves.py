"""The picture of a run: reward per optimizer step, and greedy accuracy before and after training.

Needs matplotlib, an optional extra (`pip install "trl-async[plots]"`); without it the recipe skips the picture
and says so.
"""

from __future__ import annotations

import os


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(log_history: list[dict], eval_results: dict | None, path: str, title: str) -> str | None:
    """Write the reward curve (and, when evaluated, the accuracy bars) to `path`; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    points = [(entry["step"], entry["reward"]) for entry in log_history if "reward" in entry and "step" in entry]
    panels = 2 if eval_results is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels + 1.0, 3.8), squeeze=False)
    ax = axes[0][0]
    if points:
        steps, rewards = zip(*points, strict=True)
        window = max(1, len(rewards) // 20)
        ax.plot(steps, rewards, color="tab:blue", alpha=0.3, linewidth=0.8, label="reward (per step)")
        ax.plot(steps, moving_average(list(rewards), window), color="tab:blue", linewidth=2.0,
                label=f"moving average ({window} steps)")  # fmt: skip
        ax.legend(loc="lower right", fontsize=8)
    calls = [(entry["step"], entry["tools/call_frequency"]) for entry in log_history
             if entry.get("tools/call_frequency") is not None and "step" in entry]  # fmt: skip
    if calls:  # runs with tools: TRL's tool calls per completion, and the share that failed
        failures = [(entry["step"], entry["tools/failure_frequency"]) for entry in log_history
                    if entry.get("tools/failure_frequency") is not None and "step" in entry]  # fmt: skip
        window = max(1, len(calls) // 20)
        ax.plot([s for s, _ in calls], moving_average([c for _, c in calls], window), color="tab:orange",
                linewidth=1.5, label="tool calls per completion")  # fmt: skip
        if failures:
            ax.plot([s for s, _ in failures], moving_average([f for _, f in failures], window), color="tab:red",
                    linewidth=1.0, linestyle="--", label="failed tool calls (share)")  # fmt: skip
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the step's completions" + (" / tool calls" if calls else ""))
    ax.set_title("Training reward")
    ax.grid(alpha=0.3)
    if eval_results is not None:
        ax = axes[0][1]
        labels = ["before", "after"]
        values = [eval_results[k]["accuracy"] for k in labels]
        lows = [v - eval_results[k]["ci95"][0] for k, v in zip(labels, values, strict=True)]
        highs = [eval_results[k]["ci95"][1] - v for k, v in zip(labels, values, strict=True)]
        bars = ax.bar(labels, values, color=["tab:gray", "tab:green"], yerr=[lows, highs], capsize=6)
        for bar, key in zip(bars, labels, strict=True):
            result = eval_results[key]
            ax.annotate(f"{result['accuracy']:.3f}\n({result['correct']}/{result['total']})",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2), ha="center", va="center",
                        fontsize=9, color="white", fontweight="bold")  # fmt: skip
        ax.set_ylim(0, 1)
        ax.set_ylabel("greedy accuracy (95% interval)")
        tools = " (tools executed)" if eval_results.get("tools") else ""
        ax.set_title(f"Held-out accuracy{tools}, n={eval_results['num_samples']}")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
