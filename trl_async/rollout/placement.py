"""Where the generation process runs and how many CPU threads each process gets.

On a GPU the answer is explicit: `generation_device` (default: the rank's own device). On a CPU the trainer and its
generation process share the rank's threads. Both run at once once the queue is open, so oversubscribing the cores
(each process using all of them) makes both slower: OpenMP threads spin while their cores run the other process. So the
two processes split one **thread budget** instead of each taking it:

* the budget is what the user (or the launcher) gave the rank: `OMP_NUM_THREADS` (torchrun and `accelerate launch` set
  it per rank), else a `torch.set_num_threads(n)` made before training with n below the rank's cores (accelerate does
  this for multi-process CPU runs without `OMP_NUM_THREADS`), else the rank's cores (`rank_cores`);
* the generator gets `generation_num_threads` (default half the budget, at least 1), the trainer the rest (at least 1).

A budget of 1 cannot be split: both processes then run one thread each. Where they share one core, the OS time-shares
it between them: single-threaded processes interleave without the barrier stalls that make oversubscribed OpenMP slow,
each gets the whole core while the other waits, and generation overlaps the trainer's waits rather than its compute.
That is logged (`Placement.note`), with how to give the rank a real budget.

The split applies from the spawn on: while the generation process starts, its imports and model build keep a core busy
(and the trainer produces the first batches itself). When a budget is split, a process that waits lends its share to
the other (`cores.CoreLending`, `lend_idle_cores`): the working one uses the whole budget, never more.
"""

from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class Placement:
    device: str  # the generation process's device
    generator_threads: int
    trainer_threads: int | None  # the trainer's torch threads while the generator runs; None: leave them as they are
    cores: int = 1  # threads a process may use while the other waits (the budget, where it is split)
    lend_cores: bool = False  # lend a waiting process's share to the other (only where the budget is split)
    budget: int | None = None  # threads the two processes share (both on the CPU), see `thread_budget`
    budget_source: str = ""  # where the budget comes from, for the log
    note: str | None = None  # a warning to log: a budget too small to split


def rank_cores(local_world_size: int) -> int:
    """CPU cores available to one rank (the process's affinity split among the ranks of this node)."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available // max(1, local_world_size))


def thread_budget(omp_num_threads: str | None, torch_threads: int, cores: int) -> tuple[int, str]:
    """(threads the rank's two processes share, where that number comes from).

    `OMP_NUM_THREADS` when it is a positive integer; else `torch_threads` (torch's thread count before training) when
    it is below `cores`, which torch's default never is (it is every core, or every physical core): someone called
    `torch.set_num_threads`; else the rank's `cores`."""
    omp = (omp_num_threads or "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    if 1 <= torch_threads < cores:
        return torch_threads, f"torch.set_num_threads({torch_threads})"
    return cores, f"{cores} cores for this rank"


def choose_placement(
    generation_device: str | None,
    trainer_device: torch.device,
    generation_num_threads: int | None,
    cores: int,
    omp_num_threads: str | None,
    lend_idle_cores: bool = False,
    torch_threads: int | None = None,
) -> Placement:
    """Where the generation process runs and the thread split (see the module docstring). `torch_threads`: torch's
    thread count in the trainer before training (`torch.get_num_threads()`; None counts as the rank's cores)."""
    device = generation_device or str(trainer_device)
    generator_on_cpu = torch.device(device).type == "cpu"
    budget, source = thread_budget(omp_num_threads, cores if torch_threads is None else torch_threads, cores)
    shares_threads = generator_on_cpu and torch.device(trainer_device).type == "cpu"
    if not shares_threads:  # the generator computes on an accelerator, or only it is on the CPU: nothing to split
        threads = generation_num_threads
        if threads is None:
            threads = min(max(1, cores // 2), budget) if generator_on_cpu else 1
        return Placement(device, threads, None, cores=cores)
    threads = generation_num_threads or max(1, budget // 2)
    trainer_threads = max(1, budget - threads)
    note = None
    if budget == 1 and generation_num_threads is None:
        where = (
            f"this rank's {cores} cores run them in parallel"
            if cores > 1
            else "they time-share this rank's one core: the OS interleaves two single-threaded processes without the "
            "barrier stalls of oversubscribed OpenMP, each gets the whole core while the other waits, and generation "
            "overlaps the trainer's waits rather than its compute. Give each rank 2 or more cores and "
            "OMP_NUM_THREADS >= 2 for the two processes to compute in parallel"
        )
        note = (
            f"trl_async: this rank's thread budget is 1 ({source}), which two processes cannot split: the trainer and "
            f"its generation process run one thread each ({where})."
        )
    elif threads + trainer_threads > budget:
        note = (
            f"trl_async: generation_num_threads={threads} leaves no thread of this rank's budget of {budget} "
            f"({source}) to the trainer, which runs {trainer_threads} thread beside them."
        )
    lend = lend_idle_cores and budget > 1 and threads + trainer_threads == budget
    return Placement(
        device, threads, trainer_threads, cores=budget, lend_cores=lend, budget=budget, budget_source=source, note=note
    )
