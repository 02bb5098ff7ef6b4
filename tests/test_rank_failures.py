"""A crash on one rank of two (`accelerate launch`, two gloo processes on CPU), as torch elastic promises: a reward
function that raises on rank 1 only, rank 1's generation process SIGKILLed, rank 1's trainer SIGKILLed.

In each case both ranks exit non-zero, the error names the rank and the cause, no rank hangs in a collective, and no
process or /dev/shm entry of either rank is left. The generators' heartbeat timeout is set far beyond the launcher's
timeout here, so a run that needed it to notice the fault fails the test instead of passing late.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.faults import SCRIPT, assert_nothing_left, read
from tests.support.trainer_utils import free_port

LAUNCH_TIMEOUT_S = 900  # the script's generator_heartbeat_timeout is 3600 s


def launch_two_ranks(tmp_path, fault: str) -> subprocess.CompletedProcess:
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
    ]  # fmt: skip
    options = ["--output-dir", str(tmp_path / "out"), "--records", str(tmp_path / "records"), "--fault", fault,
               "--save-steps", "1000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    return subprocess.run(
        [*launcher, SCRIPT, *options], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env
    )


def check_rank_0_was_stopped(records, stderr: str) -> None:
    """Rank 0 did nothing wrong: the launcher stopped it (SIGTERM, which trl_async turns into exit code 143 after its
    cleanup), or its next collective failed when rank 1 went away. Either way it ended non-zero, saying so."""
    exit_record = read(records, "exit.json", rank=0)
    assert exit_record is not None and exit_record["type"] is not None, exit_record
    if exit_record["type"] == "SystemExit":
        assert exit_record["code"] == 143
        assert "the trainer of rank 0 received SIGTERM" in stderr


@pytest.mark.slow
def test_a_reward_that_raises_on_rank_1_ends_both_ranks(tmp_path):
    proc = launch_two_ranks(tmp_path, "reward_raises@rank:1")
    records = tmp_path / "records"
    assert proc.returncode != 0
    exit_record = read(records, "exit.json", rank=1)
    assert exit_record["type"] == "GeneratorError"
    # The reward's own error comes first (it says what to do), then which process raised it.
    assert exit_record["message"].startswith("ValueError: this reward fails on purpose on rank 1")
    assert "(raised in the generation process of rank 1, pid " in exit_record["message"]
    check_rank_0_was_stopped(records, proc.stderr)
    for rank in (0, 1):
        assert_nothing_left(read(records, "info.json", rank=rank))


@pytest.mark.slow
def test_a_generator_killed_on_rank_1_ends_both_ranks(tmp_path):
    proc = launch_two_ranks(tmp_path, "kill_generator@rank:1:step:3")
    records = tmp_path / "records"
    assert proc.returncode != 0
    exit_record = read(records, "exit.json", rank=1)
    assert exit_record["type"] == "GeneratorError"
    assert "The generation process of rank 1" in exit_record["message"]
    assert "exited with code -9" in exit_record["message"]
    check_rank_0_was_stopped(records, proc.stderr)
    for rank in (0, 1):
        assert_nothing_left(read(records, "info.json", rank=rank))


@pytest.mark.slow
def test_rank_1s_trainer_killed_ends_both_ranks_and_its_spool_is_removed(tmp_path):
    proc = launch_two_ranks(tmp_path, "kill_trainer@rank:1:step:3")
    records = tmp_path / "records"
    assert proc.returncode != 0
    assert read(records, "exit.json", rank=1) is None  # SIGKILL: no code ran; the launcher names rank and signal
    summary = proc.stderr[proc.stderr.rfind("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in summary and "exitcode  : -9" in summary, summary
    check_rank_0_was_stopped(records, proc.stderr)
    for rank in (0, 1):
        assert_nothing_left(read(records, "info.json", rank=rank))
