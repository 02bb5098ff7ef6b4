"""Interrupts and failed writes, with real processes: Ctrl-C, SIGTERM and SIGKILL to the trainer at chosen and random
moments (during a checkpoint save included), and a full, size-limited or read-only disk at checkpoint time.

After each: the trainer's generation process, spool janitor and every other process it started are gone, nothing of
it is left in /dev/shm, the newest *complete* checkpoint is the one the run finished last (a partial one is never taken
for it), and a run resumed with `resume_from_checkpoint=True` continues from it to the end. The runs are
tests/scripts/faulty_run.py (its header lists the faults).
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from transformers.trainer_utils import get_last_checkpoint

from tests.support.faults import SCRIPT, assert_nothing_left, read, sigint_as_in_a_terminal, wait_until_gone
from tests.support.trainer_utils import load_model, load_tokenizer, make_args, pid_is_gone
from trl_async import AsyncGRPOTrainer
from trl_async.toy import make_arithmetic_dataset
from trl_async.trainers.checkpoints import (
    ROLLOUT_STATE_FILE,
    begin_save,
    check_resumable,
    finish_save,
    incomplete_marker,
    is_complete_checkpoint,
    last_complete_checkpoint,
    resume_checkpoint_dir,
)

MAX_STEPS, SAVE_STEPS = 12, 3


# --------------------------------------------------------------------------------------------------- helpers
def run_script(output_dir, records, *options, prefix=(), timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [*prefix, sys.executable, SCRIPT, "--output-dir", str(output_dir), "--records", str(records), *options]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=sigint_as_in_a_terminal
    )


def step_of(checkpoint) -> int:
    return int(os.path.basename(checkpoint).rsplit("-", 1)[1])


def expected_exit(sig) -> set[int]:
    # SIGTERM: trl_async's SystemExit(143). SIGINT: KeyboardInterrupt, which Python turns into death by SIGINT (-2) or
    # exit status 130. SIGKILL: death by SIGKILL.
    return {signal.SIGTERM: {143}, signal.SIGINT: {-signal.SIGINT, 130}, signal.SIGKILL: {-signal.SIGKILL}}[sig]


def interrupt_and_resume(tmp_path, fault: str, sig) -> dict:
    """Run with `fault`, check what it left, resume; returns what the checks saw."""
    out, records = tmp_path / "out", tmp_path / "records"
    run = run_script(out, records, "--fault", fault, "--save-total-limit", "1")
    fired = read(records, "fired.json")
    assert fired is not None, f"the run never sent itself {fault}: {run.stderr[-3000:]}"
    if sig == signal.SIGINT:  # ignored or blocked, the signal would be dropped and the run would go on to exit 0
        assert fired["sigint_at_start"] == "KeyboardInterrupt", fired
    assert run.returncode in expected_exit(sig), (run.returncode, fired, run.stderr[-3000:])
    if sig == signal.SIGTERM:
        assert "the trainer of rank 0 received SIGTERM" in run.stderr
    assert_nothing_left(read(records, "info.json"))
    saved = [r["step"] for r in read(records, "saved.jsonl") or []]
    begun = [r["step"] for r in read(records, "saving.jsonl") or []]
    # The newest complete checkpoint is the last save that returned; any newer folder is partial. A signal at a random
    # moment (a timer) may also fall between a save's completion (its marker removed) and its return, while it rotates
    # older checkpoints away: that save is then the newest complete one, and an older one may be left half deleted.
    random_moment = fired["moment"].startswith("timer:")
    newest = last_complete_checkpoint(str(out))
    returned = str(out / f"checkpoint-{saved[-1]}") if saved else None
    stopped = str(out / f"checkpoint-{begun[-1]}") if random_moment and len(begun) > len(saved) else None
    assert newest == returned or (newest == stopped and stopped is not None), (newest, saved, begun, fired)
    if newest == stopped and stopped is not None:  # complete means every file, trl_async's last one included
        assert os.path.isfile(os.path.join(newest, ROLLOUT_STATE_FILE)), os.listdir(newest)
    partial = [
        p
        for p in sorted(out.glob("checkpoint-*"))
        if p.is_dir() and str(p) != newest and not (random_moment and newest and step_of(p) < step_of(newest))
    ]
    for folder in partial:
        assert not is_complete_checkpoint(str(folder))
        with pytest.raises(ValueError, match="partial checkpoint"):
            check_resumable(str(folder))
    if newest is None:
        return {"saved": saved, "partial": partial}
    resumed_records = tmp_path / "resumed"
    resumed = run_script(out, resumed_records, "--phase", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read(resumed_records, "train.json") == {"first_step": step_of(newest), "last_step": MAX_STEPS}
    assert_nothing_left(read(resumed_records, "info.json"))
    return {"saved": saved, "partial": partial}


# --------------------------------------------------------------------------------------------------- pure rules
def _fake_checkpoint(folder, complete=True):
    os.makedirs(folder)
    if complete:
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write("{}")


def test_a_checkpoint_is_complete_with_its_trainer_state_and_without_a_marker(tmp_path):
    folder = str(tmp_path / "checkpoint-4")
    begin_save(folder)
    _fake_checkpoint(folder)
    assert os.path.exists(incomplete_marker(folder)) and not is_complete_checkpoint(folder)
    finish_save(folder)
    assert is_complete_checkpoint(folder)
    _fake_checkpoint(str(tmp_path / "checkpoint-5"), complete=False)  # interrupted before Trainer's last file
    assert not is_complete_checkpoint(str(tmp_path / "checkpoint-5"))
    _fake_checkpoint(str(tmp_path / "checkpoint-1"))  # written by TRL or transformers: no marker, complete
    assert is_complete_checkpoint(str(tmp_path / "checkpoint-1"))


def test_the_newest_complete_checkpoint_is_found_by_step_not_by_name(tmp_path):
    for step in (2, 10, 12):
        _fake_checkpoint(str(tmp_path / f"checkpoint-{step}"))
    begin_save(str(tmp_path / "checkpoint-14"))
    _fake_checkpoint(str(tmp_path / "checkpoint-14"))
    _fake_checkpoint(str(tmp_path / "checkpoint-16"), complete=False)
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-16")  # what transformers would resume
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")
    with pytest.raises(ValueError, match=r"checkpoint-14.*partial.*'.*checkpoint-12', the newest complete"):
        check_resumable(str(tmp_path / "checkpoint-14"))
    with pytest.raises(ValueError, match=r"checkpoint-16.*no trainer_state.json"):
        check_resumable(str(tmp_path / "checkpoint-16"))
    check_resumable(str(tmp_path / "checkpoint-10"))  # complete: no error


def test_the_checkpoint_checked_before_resume_true_is_the_newest_complete_one(tmp_path):
    """`resume_checkpoint_dir(True, ...)`, the folder `check_resume` reads, follows the module's rule (one reader:
    `last_complete_checkpoint`), not transformers' newest folder."""
    for step in (3, 6):  # saved as the trainers save: marked, written, unmarked
        begin_save(str(tmp_path / f"checkpoint-{step}"))
        _fake_checkpoint(str(tmp_path / f"checkpoint-{step}"))
        finish_save(str(tmp_path / f"checkpoint-{step}"))
    begin_save(str(tmp_path / "checkpoint-9"))  # interrupted after Trainer's last file, before the marker went
    _fake_checkpoint(str(tmp_path / "checkpoint-9"))
    _fake_checkpoint(str(tmp_path / "checkpoint-12"), complete=False)  # interrupted before Trainer's last file
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")  # what transformers would resume
    assert resume_checkpoint_dir(True, str(tmp_path)) == str(tmp_path / "checkpoint-6")
    assert resume_checkpoint_dir(True, str(tmp_path / "no-run-yet")) is None  # transformers reports that itself
    assert resume_checkpoint_dir(str(tmp_path / "checkpoint-3"), str(tmp_path)) == str(tmp_path / "checkpoint-3")


def test_train_refuses_a_partial_checkpoint_and_resumes_true_only_from_a_complete_one(tmp_path):
    out = tmp_path / "out"
    _fake_checkpoint(str(out / "checkpoint-2"), complete=False)
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=make_args(tmp_path), train_dataset=make_arithmetic_dataset(num_train=16, num_test=2)["train"],
        processing_class=load_tokenizer(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="partial checkpoint"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        trainer.train(resume_from_checkpoint=True)


# --------------------------------------------------------------------------------------------------- interrupts
def test_sigterm_during_a_save_keeps_the_previous_checkpoint_with_save_total_limit_1(tmp_path):
    """SIGTERM after Trainer wrote (and, untouched, would have rotated) checkpoint-6 and before trl_async's last file:
    checkpoint-6 looks complete to transformers, yet the resume starts from checkpoint-3, which a save_total_limit of
    1 must not have deleted."""
    seen = interrupt_and_resume(tmp_path, "signal:TERM@saving:rollout_state:2", signal.SIGTERM)
    assert seen["saved"] == [3]
    assert [p.name for p in seen["partial"]] == ["checkpoint-6"]
    assert get_last_checkpoint(str(tmp_path / "out")) == str(tmp_path / "out" / "checkpoint-6")


@pytest.mark.slow
@pytest.mark.parametrize("runner_sigint", ["default", "ignored"])
def test_ctrl_c_while_the_weights_are_written(tmp_path, runner_sigint):
    """Ctrl-C ends the run, never a clean exit, and the checkpoint being written stays partial. "ignored": the test
    runner ignores SIGINT, as one started in the background of a non-interactive shell does (`bash .ci/run &`); its
    children inherit that, so the run must be started as a terminal would start it (`sigint_as_in_a_terminal`), or the
    Ctrl-C is dropped and the run goes on to exit 0."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if runner_sigint == "ignored" else None
    try:
        seen = interrupt_and_resume(tmp_path, "signal:INT@saving:model:2", signal.SIGINT)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    assert seen["saved"] == [3] and [p.name for p in seen["partial"]] == ["checkpoint-6"]


def test_sigkill_of_the_trainer_leaves_no_process_and_nothing_in_dev_shm(tmp_path):
    """The trainer runs no code: the spool janitor removes the spool, and the generation process, waiting at the gate
    (so nothing it writes fails), notices its trainer died although the trainer, a zombie, is not reaped until this
    test has read all of the run's output, which the generation process holds open too."""
    seen = interrupt_and_resume(tmp_path, "signal:KILL@saving:optimizer:2:gated", signal.SIGKILL)
    assert seen["saved"] == [3]


def _process_group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that have not exited (from /proc; a zombie has exited)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(group) == pgid and state not in ("Z", "X"):
                members.append(int(entry))
    return members


def _read_when_written(records, name, process, guard_s=600.0):
    """A record of the run once it is written whole, or None if the run ends (or the guard runs out) first."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            found = read(records, name)
        except ValueError:  # being written
            found = None
        if found is not None:
            return found
        time.sleep(0.2)
    return None


def test_sigkill_of_the_trainers_whole_process_group_leaves_no_process_and_nothing_in_dev_shm(tmp_path):
    """Issue 33, guarantee 2: a signal to the trainer's whole process group (`kill -9 -PGID`, as a job runner stops a
    job; a terminal's Ctrl-\\ sends SIGQUIT the same way) reaches every process of the group at once. The spool
    janitor must not be one of them: it outlives the group, removes the spool in /dev/shm and exits. The run is
    started in a session of its own, so the group is the run alone (and never this test)."""
    records = tmp_path / "records"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, SCRIPT, "--output-dir", str(tmp_path / "out"), "--records", str(records),
           "--max-steps", "100000", "--save-steps", "100000"]  # fmt: skip
    with open(tmp_path / "output.txt", "w") as output:
        run = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        # Written at the end of the first step trained on a batch of the serving generation process.
        info = _read_when_written(records, "info.json", run)
        assert info is not None, (run.poll(), (tmp_path / "output.txt").read_text()[-3000:])
        pgid = os.getpgid(run.pid)
        assert pgid == run.pid == info["trainer_pid"]
        assert glob.glob(f"/dev/shm/trl_async-{run.pid}-*") == [info["spool"]]  # the spool exists, named by its owner
        assert not pid_is_gone(info["janitor_pid"]) and not pid_is_gone(info["generator_pid"])
        assert info["generator_pid"] in _process_group_members(pgid)
        os.killpg(pgid, signal.SIGKILL)
        assert run.wait(timeout=120) == -signal.SIGKILL
    finally:
        if run.poll() is None:  # a failed premise: stop the run
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    try:
        assert wait_until_gone(_process_group_members(pgid)) == []
        assert_nothing_left(info)  # the janitor and every other process the trainer started exited; the spool is gone
        assert glob.glob(f"/dev/shm/trl_async-{run.pid}-*") == []
    finally:
        shutil.rmtree(info["spool"], ignore_errors=True)  # what a failure left behind, not /dev/shm's to keep


def _random_interrupts(count: int) -> list[tuple[int, str]]:
    """`count` interrupts drawn from one seeded sequence: (signal, where it lands)."""
    rng = random.Random(2025)
    moments = ["step", "timer", "saving:model", "saving:optimizer", "saving:rollout_state"]
    drawn = []
    for _ in range(count):
        sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
        moment = rng.choice(moments)
        if moment == "step":
            where = f"step:{rng.randint(2, MAX_STEPS - 1)}"
        elif moment == "timer":
            where = f"timer:{rng.randint(0, 10**6)}"
        else:
            where = f"{moment}:{rng.randint(1, 3)}"
        drawn.append((sig, where))
    return drawn


# The first four of the eight draws in CI's slow suite, the other four nightly (benchmarks/nightly.sh), for CI's hour.
@pytest.mark.slow
@pytest.mark.parametrize(
    "trials",
    [pytest.param(range(0, 4), id="first_four"), pytest.param(range(4, 8), id="last_four", marks=pytest.mark.nightly)],
)
def test_interrupts_at_random_moments(tmp_path, trials):
    drawn = _random_interrupts(8)
    for trial in trials:
        sig, where = drawn[trial]
        name = {signal.SIGINT: "INT", signal.SIGTERM: "TERM", signal.SIGKILL: "KILL"}[sig]
        interrupt_and_resume(tmp_path / str(trial), f"signal:{name}@{where}", sig)


# --------------------------------------------------------------------------------------------------- full disks
def _namespace_prefix() -> list[str] | None:
    """`unshare` into a user and mount namespace where this process may mount a tmpfs, if the system allows it."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return ["unshare", "--user", "--map-root-user", "--mount"] if probe.returncode == 0 else None


def _check_failed_save(tmp_path, run, records, resumed_records):
    assert run.returncode != 0
    exit_record = read(records, "exit.json")
    assert exit_record["type"] == "CheckpointSaveError", exit_record
    folder = str(tmp_path / "out" / "checkpoint-6")
    assert f"Saving the checkpoint {folder} failed" in exit_record["message"]
    assert (
        f"the previous complete checkpoint, {tmp_path / 'out' / 'checkpoint-3'}, is intact" in exit_record["message"]
    )
    assert read(records, "saved.jsonl") == [{"step": 3}]
    assert_nothing_left(read(records, "info.json"))
    # The previous checkpoint loads and training resumes from it (run where the disk is: inside the namespace).
    assert read(resumed_records, "exit.json") == {"type": None}
    assert read(resumed_records, "train.json") == {"first_step": 3, "last_step": MAX_STEPS}
    assert_nothing_left(read(resumed_records, "info.json"))


@pytest.mark.slow
def test_a_file_size_limit_at_checkpoint_time_names_the_folder_and_keeps_the_previous_one(tmp_path):
    """RLIMIT_FSIZE makes every larger write fail (EFBIG) as a full disk would, wherever this runs."""
    records, resumed = tmp_path / "records", tmp_path / "resumed"
    run = run_script(tmp_path / "out", records, "--fault", "file_size_limit@save:2")
    assert run.returncode != 0
    resume = run_script(tmp_path / "out", resumed, "--phase", "resume")
    assert resume.returncode == 0, resume.stderr[-3000:]
    _check_failed_save(tmp_path, run, records, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["tmpfs_full", "read_only"])
def test_a_full_or_read_only_disk_at_checkpoint_time(tmp_path, disk):
    """A real 20 MB tmpfs as output_dir (one checkpoint of the tiny model fits, two do not: ENOSPC), or the same tmpfs
    remounted read-only before the second save (EROFS). It lives in a private mount namespace, so the resumed run
    runs there too, before the namespace (and the tmpfs) goes."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip("this system does not let an unprivileged process mount a tmpfs (unshare --user --mount)")
    out, records, resumed = tmp_path / "out", tmp_path / "records", tmp_path / "resumed"
    out.mkdir()
    fault = "none" if disk == "tmpfs_full" else "read_only@save:2"
    script = " ".join([sys.executable, SCRIPT, "--output-dir", str(out)])
    shell = (
        f"mount -t tmpfs -o size=20m tmpfs {out} && "
        f"{script} --records {records} --fault {fault}; echo $? > {tmp_path / 'run_status'}; "
        f"mount -o remount,rw {out} && rm -rf {out}/checkpoint-6 && {script} --records {resumed} --phase resume"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*prefix, "sh", "-c", shell], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.CompletedProcess([], int((tmp_path / "run_status").read_text()))
    _check_failed_save(tmp_path, run, records, resumed)
    message = read(records, "exit.json")["message"]
    if disk == "tmpfs_full":  # torch's own error says "unexpected pos": the message adds how full the disk is
        free_mib = float(re.search(r"([0-9.]+) MiB free on its disk", message).group(1))
        assert free_mib < 4.0  # less than the model's weights (4 MB)
    else:
        assert "Read-only file system" in message
