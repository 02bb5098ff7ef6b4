"""Two training processes on CPU (gloo) under a real `accelerate launch`, each with its own generator."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.trainer_utils import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_ranks.py")


def run_two_ranks(launcher: list[str], out, loss_type: str = "m2po"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*launcher, SCRIPT, str(out), loss_type], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


def check_ranks(ranks):
    assert [r["process_index"] for r in ranks] == [0, 1]
    assert all(r["num_processes"] == 2 for r in ranks)
    assert all(r["backend"] == "gloo" for r in ranks)
    # Two ranks, two generators, each its own OS process.
    pids = [r["generator_pids"] for r in ranks]
    assert all(len(p) == 1 for p in pids) and pids[0] != pids[1]
    assert ranks[0]["trainer_pid"] != ranks[1]["trainer_pid"]
    # The same number of rows per rank per step, for every step.
    assert ranks[0]["rows_per_step"] == ranks[1]["rows_per_step"] == [8] * 4
    # Staleness from the weights that generated each batch (their μ), and the engine's tags name those weights.
    assert all(len(r["true_staleness"]) == 4 and max(r["true_staleness"]) <= 1 for r in ranks)
    assert all(all(r["tag_is_true"]) for r in ranks)
    # DDP kept the replicas identical.
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=1e-9)
    assert ranks[0]["param_checksum"] != pytest.approx(ranks[0]["initial_param_checksum"], rel=1e-9)
    # Generators are gone after the run.
    for pid in (p[0] for p in pids):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_accelerate_launch_two_cpu_processes(tmp_path):
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip
    check_ranks(run_two_ranks(launcher, tmp_path, loss_type="dapo"))


@pytest.mark.slow
def test_torchrun_two_cpu_processes(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]  # fmt: skip
    check_ranks(run_two_ranks(launcher, tmp_path, loss_type="dapo"))
