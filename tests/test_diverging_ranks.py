"""Several processes never fall out of step: every collective runs on every rank, in the same order, with the same
shapes, whatever each rank's batch (docs/architecture.md, "Several processes").

The ranks are made to differ on purpose (one generation process late or never ready, different staleness, eviction
on one rank only, in-flight updates, PPO, M2PO's global scope, batches reused over two iterations), and each case
runs at least 60 steps past the moment they diverge, under a real `accelerate launch` with the project's collective
check on (`TRL_ASYNC_CHECK_COLLECTIVES=1`: a rank that skips, adds or reshapes a collective fails the run with both
ranks' calls named). The check itself is tested first, on two real processes.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.trainer_utils import free_port, pid_is_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "diverging_ranks.py")
STEPS_PAST_DIVERGENCE = 60


def _env(**extra) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "ACCELERATE_USE_CPU": "1",
        "TRL_ASYNC_CHECK_COLLECTIVES": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


# ----------------------------------------------------------------------------------------------- the check itself
_CHECK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from trl_async.trainers import collectives
    from trl_async.trainers.collectives import CollectiveMismatchError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = os.path.join(sys.argv[1], f"rank{rank}.txt")  # one file a rank: their outputs do not interleave
    assert collectives.install_if_requested()
    dist.all_reduce(torch.ones(3))  # the same call on both ranks: passes
    dist.barrier()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(3, dtype=torch.float64))  # rank 0's call
        else:
            dist.all_reduce(torch.ones(5, dtype=torch.float64))  # rank 1's call: another shape, another line
    except CollectiveMismatchError as error:
        open(report, "w").write(f"CAUGHT: {error}")
        dist.destroy_process_group()
        sys.exit(3)
    open(report, "w").write("NOT CAUGHT")
    dist.destroy_process_group()
    """
)


def _run_check_script(tmp_path, name: str, text: str, processes: int = 2) -> subprocess.CompletedProcess:
    """`text` as `name` on `processes` real processes (gloo, `torch.distributed.run`), with the check on; each rank
    reports in `tmp_path/rank{k}.txt`."""
    script = tmp_path / name
    script.write_text(text)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(free_port()), str(script), str(tmp_path)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)


def _line_of(text: str, fragment: str) -> int:
    """The line number of the one line of `text` that holds `fragment`."""
    (number,) = [n for n, line in enumerate(text.splitlines(), start=1) if fragment in line]
    return number


def test_the_collective_check_names_both_ranks_calls_on_a_mismatch(tmp_path):
    """Two real processes (gloo) reach differently shaped all-reduces from different lines: with the check on, each
    rank raises `CollectiveMismatchError` naming both calls (shape, dtype, file and line) instead of gloo's transport
    error or a hang; the calls before it, the same on both ranks, pass."""
    proc = _run_check_script(tmp_path, "mismatch.py", _CHECK_SCRIPT)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    lines = _CHECK_SCRIPT.splitlines()
    line_of = {shape: lines.index(next(x for x in lines if f"torch.ones({shape}, dtype" in x)) + 1 for shape in (3, 5)}
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith("CAUGHT: "), report
        assert f"rank 0: all_reduce float64 (3,) at mismatch.py:{line_of[3]}" in report, report
        assert f"rank 1: all_reduce float64 (5,) at mismatch.py:{line_of[5]}" in report, report
        assert "after: barrier" in report  # each rank's previous call, for orientation


_SAME_SITE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from trl_async.trainers import collectives
    from trl_async.trainers.collectives import CollectiveMismatchError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = os.path.join(sys.argv[1], f"rank{rank}.txt")
    assert collectives.install_if_requested()
    # Each step, each rank pads its batch to its own longest completion; at step 2 the ranks' longest differ.
    for step, longest in enumerate([(5, 5), (6, 6), (7, 9)]):
        try:
            dist.all_reduce(torch.zeros(4, longest[rank]))  # the one call site
        except CollectiveMismatchError as error:
            open(report, "w").write(f"CAUGHT at step {step}: {error}")
            dist.destroy_process_group()
            sys.exit(3)
    open(report, "w").write("NOT CAUGHT")
    dist.destroy_process_group()
    """
)


def test_the_same_call_with_another_shape_on_each_rank_is_named_with_both_shapes(tmp_path):
    """The commonest divergence: both ranks at the same line, each with a tensor sized by its own data. Two real
    processes (gloo): the steps where the shapes agree pass; where they differ, each rank raises, naming the call site
    once and both shapes, and says what to do, instead of gloo's abort."""
    proc = _run_check_script(tmp_path, "same_site.py", _SAME_SITE_SCRIPT)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    site = f"same_site.py:{_line_of(_SAME_SITE_SCRIPT, 'the one call site')} in <module>"
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith("CAUGHT at step 2: "), report
        assert f"rank 0: all_reduce float32 (4, 7) at {site} (after: all_reduce float32 (4, 6) at {site})" in report
        assert f"rank 1: all_reduce float32 (4, 9) at {site}" in report, report
        assert (
            f"Every rank is at the same call, all_reduce at {site}, with a tensor of another shape or dtype: "
            "float32 (4, 7) on rank 0, float32 (4, 9) on rank 1." in report
        ), report


_SUB_GROUP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from trl_async.trainers import collectives
    from trl_async.trainers.collectives import CollectiveMismatchError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = os.path.join(sys.argv[1], f"rank{rank}.txt")
    pair = dist.new_group([0, 1])  # made by every rank; rank 2 is not in it
    assert collectives.install_if_requested()
    try:
        if rank in (0, 1):
            dist.barrier(pair)  # the group by position
            dist.all_reduce(torch.ones(3), dist.ReduceOp.SUM, pair)  # by position too
        dist.all_reduce(torch.ones(2))  # the world's: all three ranks
        if rank in (0, 1):
            dist.all_reduce(torch.ones(4 if rank == 0 else 6), dist.ReduceOp.SUM, pair)  # the pair differs
    except CollectiveMismatchError as error:
        open(report, "w").write(f"CAUGHT: {error}")
        dist.destroy_process_group()
        sys.exit(3)
    open(report, "w").write(f"IN STEP after {collectives.checked_collectives()} collectives of the world")
    dist.destroy_process_group()
    """
)


def test_a_sub_group_passed_by_position_is_checked_within_that_group(tmp_path):
    """Three real processes (gloo), a group of ranks 0 and 1 passed by position (`dist.barrier(pair)`,
    `dist.all_reduce(t, op, pair)`): its collectives are compared among its two ranks only, while rank 2, outside it,
    goes on with the world's collectives in step; a mismatch within the group is named by the two ranks' world ranks
    and the group's."""
    proc = _run_check_script(tmp_path, "sub_group.py", _SUB_GROUP_SCRIPT, processes=3)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "rank2.txt").read_text() == "IN STEP after 1 collectives of the world"
    site = f"sub_group.py:{_line_of(_SUB_GROUP_SCRIPT, '# the pair differs')} in <module>"
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith("CAUGHT: The ranks reached different collectives (collective #2 of this run on the "
                                 f"process group of ranks [0, 1]; seen from rank {rank}):"), report  # fmt: skip
        assert f"rank 0: all_reduce float32 (4,) at {site}" in report, report
        assert f"rank 1: all_reduce float32 (6,) at {site}" in report, report
        assert "rank 2" not in report, report


def test_the_check_refuses_a_torch_whose_collective_renamed_a_parameter_it_reads():
    """The check reads each call's group and tensor by torch's parameter names: under a torch that renamed one it would
    compare nothing, so installing it fails, naming the function and the parameter."""
    from trl_async.trainers import collectives

    def all_reduce(buffer, op=None, group=None, async_op=False):  # a torch whose buffer is no longer `tensor`
        return None

    with pytest.raises(RuntimeError, match=r"torch.distributed.all_reduce\(buffer.*has no parameter 'tensor'"):
        collectives._Checker()._checked("all_reduce", all_reduce)


def test_a_log_on_the_main_process_alone_runs_no_collective(tmp_path):
    """Users log on the main process only (the recipe logs its evaluation so): the trainers' `log` must not run a
    collective there, or the other ranks, already in their next collective, would be paired with it."""
    ranks = _launch("log_on_main_only", 4, tmp_path)
    assert [r["global_step"] for r in ranks] == [4, 4]
    assert ranks[0]["collectives_checked"] == ranks[1]["collectives_checked"] > 0


# ----------------------------------------------------------------------------------------------- diverging ranks
def _launch(case: str, max_steps: int, out) -> list[dict]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), SCRIPT, str(out), case, str(max_steps),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


def _first_step_where(ranks, differ) -> int | None:
    by_step = [{b["step"]: b for b in r["batches"]} for r in ranks]
    for step in sorted(set(by_step[0]) & set(by_step[1])):
        if differ(by_step[0][step], by_step[1][step], step):
            return step
    return None


def _source_differs(a, b, step):
    return a["from_trainer"] != b["from_trainer"]


def _age_differs(a, b, step):
    return step - a["version"] != step - b["version"]


def _check_in_step_and_clean(ranks, max_steps):
    # Both trained to the end, with the check on and the same collectives (it would have raised otherwise).
    assert [r["global_step"] for r in ranks] == [max_steps] * 2
    assert ranks[0]["collectives_checked"] > 0
    assert ranks[0]["collectives_checked"] == ranks[1]["collectives_checked"]
    # Eviction agreed: both ranks trained the same stream positions (an item dropped on one is dropped on both).
    assert [b["stream_index"] for b in ranks[0]["batches"]] == [b["stream_index"] for b in ranks[1]["batches"]]
    assert all(agreed >= local for r in ranks for local, agreed, _ in r["agreements"])
    # DDP kept the replicas identical.
    assert ranks[0]["parameter_checksum"] == pytest.approx(ranks[1]["parameter_checksum"], rel=1e-9)
    # Nothing left behind: generation processes, spools.
    for r in ranks:
        assert pid_is_gone(r["generator_pid"]), r["generator_pid"]
        assert r["spool_dir"] and not os.path.exists(r["spool_dir"])


DIVERGING_CASES = {
    "late_generator": _source_differs,
    "no_generator": _source_differs,
    "different_staleness": _age_differs,
    "inflight": _source_differs,
    "ppo": _source_differs,
    "m2po_global": _source_differs,
    "two_iterations": _source_differs,
    "blocks": _age_differs,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DIVERGING_CASES))
def test_ranks_that_differ_stay_in_step(tmp_path, case):
    max_steps = 100
    ranks = _launch(case, max_steps, tmp_path)
    diverged = _first_step_where(ranks, DIVERGING_CASES[case])
    assert diverged is not None, "the ranks never differed: the case did not exercise what it is for"
    assert max_steps - diverged >= STEPS_PAST_DIVERGENCE, (diverged, max_steps)
    if case == "no_generator":  # rank 1 made every batch itself, rank 0 switched to its generation process
        assert all(b["from_trainer"] for b in ranks[1]["batches"])
        assert not ranks[0]["batches"][-1]["from_trainer"]
    if case == "late_generator":  # rank 1 switched too, later (its generator waits for rank 0's switch)
        switched = [next((b["step"] for b in r["batches"] if not b["from_trainer"]), None) for r in ranks]
        assert None not in switched and switched[0] < switched[1], switched
        assert not ranks[1]["batches"][-1]["from_trainer"]
    _check_in_step_and_clean(ranks, max_steps)


@pytest.mark.slow
def test_an_item_too_old_on_one_rank_only_is_evicted_on_both(tmp_path):
    max_steps = 100
    ranks = _launch("one_rank_evicts", max_steps, tmp_path)
    # The agreements where one rank's own candidate was fresh enough but the other rank's was not.
    bound = 1  # the case's max_staleness
    one_sided = [
        step
        for (local_0, agreed, step), (local_1, _, _) in zip(
            ranks[0]["agreements"], ranks[1]["agreements"], strict=True
        )
        if agreed > bound and min(local_0, local_1) <= bound
    ]
    assert one_sided, "no item was too old on one rank only: the case did not exercise what it is for"
    assert sum(r["evicted"] for r in ranks) > 0
    assert max_steps - min(one_sided) >= STEPS_PAST_DIVERGENCE, one_sided
    _check_in_step_and_clean(ranks, max_steps)


# ----------------------------------------------------------------------------------------------- two machines
@pytest.mark.slow
def test_two_machines_on_one_host_train_different_prompts_and_leave_nothing(tmp_path):
    """`--num_machines 2`, one process each (both local rank 0, so anything keyed by the local rank would collide):
    both train to the end, score different dataset rows at every step, and leave nothing in /dev/shm or the process
    table."""
    max_steps = 60
    port = free_port()
    procs = []
    for machine_rank in (0, 1):
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            SCRIPT, str(tmp_path), "two_machines", str(max_steps),
        ]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=_env(), cwd=ROOT))  # fmt: skip
    outputs = [p.communicate(timeout=1200)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-6000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [r["process_index"] for r in ranks] == [0, 1] and all(r["num_processes"] == 2 for r in ranks)
    # Different prompts at every step (each rank its own shard of the prompt stream).
    by_step = [{b["step"]: set(b["row_ids"]) for b in r["batches"]} for r in ranks]
    assert set(by_step[0]) == set(by_step[1]) and len(by_step[0]) == max_steps
    for step in by_step[0]:
        assert not by_step[0][step] & by_step[1][step], step
    _check_in_step_and_clean(ranks, max_steps)
    for r in ranks:  # nothing of either rank in /dev/shm (spools are named by their trainer's pid), no process left
        assert glob.glob(f"/dev/shm/trl_async-{r['trainer_pid']}-*") == []
        assert pid_is_gone(r["trainer_pid"])
