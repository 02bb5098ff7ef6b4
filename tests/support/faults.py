"""Helpers of the fault tests (tests/test_faults.py, tests/test_rank_failures.py): the records that
tests/scripts/faulty_run.py writes, and the check that a run left no process and nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.support.trainer_utils import pid_is_gone

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "faulty_run.py")


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` of a run that is sent a Ctrl-C: SIGINT at its default action and unblocked, as an interactive shell
    starts a foreground job. Both are inherited through fork and exec, and a test runner started in the background of a
    non-interactive shell (`bash .ci/run &`, `nohup ... &`, some CI agents) has SIGINT ignored: Python then installs no
    KeyboardInterrupt handler, the kernel drops the run's SIGINT, and the run trains on to its end and exits 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def read(records, name, rank=0):
    path = os.path.join(records, f"rank{rank}", name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


def wait_until_gone(pids, guard_s=120.0) -> list[int]:
    """The pids still alive after they had `guard_s` to exit (a guard against hanging, not a timing claim)."""
    deadline = time.monotonic() + guard_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not _gone(p)]
        time.sleep(0.1)
    return alive


def _gone(pid: int) -> bool:
    try:
        return pid_is_gone(pid)
    except FileNotFoundError:  # exited between the two looks
        return True


def assert_nothing_left(info) -> None:
    """Every process the trainer started has exited, its spool is removed and /dev/shm holds nothing of it."""
    assert info is not None, "the run never reached a serving generation process"
    assert info["janitor_pid"] in info["descendants"] and info["generator_pid"] in info["descendants"]
    assert wait_until_gone([info["trainer_pid"], *info["descendants"]]) == []
    assert not os.path.exists(info["spool"])
    pid = info["trainer_pid"]
    assert [e for e in os.listdir("/dev/shm") if f"-{pid}-" in e or e.startswith(f"torch_{pid}_")] == []
