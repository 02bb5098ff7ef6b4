"""What a run leaves beside the model for its card to report: summaries of the logged metrics, and the recipe's files.

The recipe (`recipes/qwen_math.py`) writes its greedy accuracy before and after training to `output_dir/eval.json`
(`write_eval_results`) and its plot to `output_dir/reward_accuracy.png`; the card (`card.py`) reads both when they
are there, and summarises the trainer's log history (`reward_summary`, `metric_summaries`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence

EVAL_RESULTS_FILE = "eval.json"  # written by the recipe (`write_eval_results`), read by the card
PLOT_FILE = "reward_accuracy.png"  # written by the recipe; the card shows it when it is in output_dir
METRIC_PREFIXES = ("async/", "m2po/", "tools/")


def reward_summary(log_history: Sequence[Mapping]) -> dict:
    """Mean logged `reward` of the first and last quarter of logged training steps, and the last one logged."""
    # TRL logs `reward: None` for steps where every reward function returned None.
    rewards = [entry["reward"] for entry in log_history if entry.get("reward") is not None]
    summary = {"steps": len(rewards), "first_quarter": None, "last_quarter": None, "gain": None}
    summary["final"] = rewards[-1] if rewards else None
    if len(rewards) >= 4:
        quarter = len(rewards) // 4
        first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
        summary.update(first_quarter=first, last_quarter=last, gain=last - first)
    calls = [entry["tools/call_frequency"] for entry in log_history if entry.get("tools/call_frequency") is not None]
    if len(calls) >= 4:  # runs with tools: TRL's tool calls per completion, first and last quarter
        quarter = len(calls) // 4
        summary["tool_call_frequency"] = {
            "first_quarter": sum(calls[:quarter]) / quarter,
            "last_quarter": sum(calls[-quarter:]) / quarter,
        }
    return summary


def metric_summaries(log_history: Sequence[Mapping], prefixes: Sequence[str] = METRIC_PREFIXES) -> dict[str, dict]:
    """Mean, max and last logged value of every metric whose name starts with one of `prefixes`, by name."""
    values: dict[str, list[float]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(tuple(prefixes)) and isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {
        key: {"mean": sum(v) / len(v), "max": max(v), "last": v[-1], "count": len(v)}
        for key, v in sorted(values.items())
    }


def write_eval_results(output_dir: str, results: Mapping) -> str:
    """Write the recipe's evaluation (schema: see `read_eval_results`) to `output_dir/eval.json`; returns the path."""
    for key in ("dataset", "num_samples", "before", "after"):
        if key not in results:
            raise ValueError(f"eval results lack the {key!r} entry")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, EVAL_RESULTS_FILE)
    with open(path, "w") as f:
        json.dump(dict(results), f, indent=2)
    return path


def read_eval_results(output_dir: str) -> dict | None:
    """`output_dir/eval.json` if present, else None.

    Schema: `dataset` (name or path), `split`, `num_samples`, `max_new_tokens`, `train_dataset` (optional:
    `{"name", "hub_id"}`; the card lists `hub_id` as the training dataset), and
    `before` / `after`, each `{"accuracy", "correct", "total", "ci95": [low, high]}`, and `gain` (after - before).
    """
    path = os.path.join(output_dir, EVAL_RESULTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
