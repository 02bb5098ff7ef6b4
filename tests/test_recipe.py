"""The recipe: bad input fails at once with clear messages; the default job raises the reward (slow)."""

import json
import os
import subprocess
import sys

import pytest

RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "recipes")
sys.path.insert(0, RECIPE_DIR)
import qwen_math  # noqa: E402

QWEN_CONFIG = os.path.join(RECIPE_DIR, "configs", "qwen2.5-0.5b-gsm8k.yaml")


def test_qwen_config_parses_to_the_real_setup():
    from trl import ModelConfig, TrlParser

    from trl_async import AsyncGRPOConfig

    parser = TrlParser((qwen_math.RecipeArguments, AsyncGRPOConfig, ModelConfig))
    recipe, args, model_args = parser.parse_args_and_config(args=["--config", QWEN_CONFIG, "--bf16", "false"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_args.use_peft and model_args.lora_r == 8 and model_args.lora_alpha == 16
    assert recipe.dataset == "openai/gsm8k"
    assert args.loss_type == "m2po" and args.max_staleness == 2


def test_qwen_config_fails_clearly_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="Qwen/Qwen2.5-0.5B-Instruct"):
        qwen_math.main(["--config", QWEN_CONFIG, "--output_dir", str(tmp_path)])


def test_missing_local_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        qwen_math.main(["--model_name_or_path", missing, "--output_dir", str(tmp_path)])


def test_missing_local_dataset_path_is_named(tmp_path):
    missing = str(tmp_path / "missing" / "gsm8k.jsonl")
    with pytest.raises(FileNotFoundError, match="missing/gsm8k.jsonl"):
        qwen_math.main(["--dataset", missing, "--output_dir", str(tmp_path)])


def test_unknown_yaml_key_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model_name_or_path: bundled:tiny_qwen2\nlearnig_rate: 1.0e-4\n")
    with pytest.raises(ValueError, match="learnig_rate"):
        qwen_math.main(["--config", str(config), "--output_dir", str(tmp_path)])


def test_unknown_reward_and_trainer_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="reward='regex'"):
        qwen_math.make_reward(qwen_math.RecipeArguments(reward="regex"), tokenizer=None)
    with pytest.raises(ValueError, match="trainer='sync'"):
        qwen_math.main(["--trainer", "sync", "--output_dir", str(tmp_path)])


def test_reward_summary_quarters():
    history = [{"reward": r} for r in [0.0, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 1.0]] + [{"train_runtime": 1.0}]
    summary = qwen_math.reward_summary(history)
    assert summary["first_quarter"] == pytest.approx(0.1) and summary["last_quarter"] == pytest.approx(0.9)
    assert summary["gain"] == pytest.approx(0.8) and summary["steps"] == 8


@pytest.mark.slow
def test_default_job_raises_reward_under_accelerate_launch(tmp_path):
    """The README's main command, shortened: the last quarter's reward beats the first's by at least 0.15."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", os.path.join(RECIPE_DIR, "qwen_math.py"),
           "--output_dir", str(tmp_path), "--max_steps", "180"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[qwen_math] mean reward: first quarter" in proc.stdout
    summary = json.loads((tmp_path / "reward_summary.json").read_text())
    assert summary["steps"] == 180
    assert summary["gain"] >= 0.15, summary
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert sum("reward" in entry for entry in state["log_history"]) == 180
    assert (tmp_path / "model.safetensors").exists()
