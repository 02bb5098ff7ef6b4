"""Long multi-process runs, as users scale: `accelerate launch --num_processes 2` on CPU (gloo), each rank with its own
generation process, with the project's collective check on (`TRL_ASYNC_CHECK_COLLECTIVES=1`: a rank that skips,
adds or reshapes a collective fails the run naming both ranks' calls).

The crash these guard against (wave 4) came at the step where the first generator batch reached one rank's queue and
not the other's: runs shorter than the generation process's start-up never met it. These run for 300 steps, far past
the moment both ranks train on generator batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.trainer_utils import free_port
from trl_async.toy import make_arithmetic_dataset, tiny_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_SCRIPT = os.path.join(ROOT, "tests", "scripts", "trl_docs_grpo.py")
RECIPE = os.path.join(ROOT, "recipes", "qwen_math.py")


def _two_processes() -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip


def _env() -> dict:
    # OMP_NUM_THREADS unset, as a user runs it (accelerate's launcher then gives each rank one thread on a CPU machine).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1", "TRL_ASYNC_CHECK_COLLECTIVES": "1",
            "PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])}  # fmt: skip


def _trained_on_generator_batches(log_history: list[dict]) -> bool:
    """Some logged window had no batch made by a trainer: every rank trained on its generation process's batches."""
    return any(h.get("async/trainer_generated_batches") == 0 for h in log_history)


@pytest.mark.slow
def test_the_docs_style_script_runs_300_steps_on_two_processes(tmp_path):
    source = open(DOCS_SCRIPT).read()
    swapped = source.replace(
        "from trl import GRPOConfig, GRPOTrainer", "from trl import GRPOConfig\nfrom trl_async import AsyncGRPOTrainer"
    ).replace("trainer = GRPOTrainer(", "trainer = AsyncGRPOTrainer(")
    assert swapped.count("AsyncGRPOTrainer") == 2  # only the class name changed
    script = tmp_path / "script.py"
    script.write_text(swapped)
    data_file = tmp_path / "prompts.jsonl"
    make_arithmetic_dataset(num_train=512, num_test=8)["train"].to_json(str(data_file))
    out = tmp_path / "out"
    command = [*_two_processes(), str(script), tiny_model_path(), str(data_file), str(out), "300"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    history = json.loads((out / "result.json").read_text())["log_history"]
    assert max(h["step"] for h in history) == 300
    assert _trained_on_generator_batches(history)


@pytest.mark.slow
@pytest.mark.nightly  # bash benchmarks/nightly.sh; CI leaves it out (its hour)
def test_the_main_job_runs_300_steps_on_two_processes(tmp_path):
    out = tmp_path / "out"
    command = [*_two_processes(), RECIPE, "--output_dir", str(out), "--max_steps", "300"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=2400, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 300
    assert _trained_on_generator_batches(state["log_history"])
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["after"]["accuracy"] is not None
