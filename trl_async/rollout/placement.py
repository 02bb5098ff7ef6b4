"""Where the generation process runs and how many CPU threads each process gets.

On a GPU the answer is explicit: `generation_device` (default: the rank's own device). On a CPU the trainer and its
generation process share the rank's cores. Both run at once once the queue is open, so oversubscribing the cores (each
process using all of them) makes both slower: OpenMP threads spin while their cores run the other process. The cores
are split instead: the generator gets `generation_num_threads` (default half, at least 1) and the trainer the rest.
The split applies from the spawn on: while the generation process starts, its imports and model build keep a core
busy (and the trainer produces the first batches itself). A user's `OMP_NUM_THREADS` is respected (it caps the
generator and leaves the trainer's count alone). When the cores are split, a process that waits lends its share to the
other (`cores.CoreLending`, `lend_idle_cores`).
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
    cores: int = 1  # the rank's cores
    lend_cores: bool = False  # lend a waiting process's share to the other (only where the cores are split)


def rank_cores(local_world_size: int) -> int:
    """CPU cores available to one rank (the process's affinity split among the ranks of this node)."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available // max(1, local_world_size))


def choose_placement(
    generation_device: str | None,
    trainer_device: torch.device,
    generation_num_threads: int | None,
    cores: int,
    omp_num_threads: str | None,
    lend_idle_cores: bool = False,
) -> Placement:
    device = generation_device or str(trainer_device)
    generator_on_cpu = torch.device(device).type == "cpu"
    omp = (omp_num_threads or "").strip()
    threads = generation_num_threads
    if threads is None:
        threads = max(1, cores // 2) if generator_on_cpu else 1
        if omp.isdigit():
            threads = min(threads, max(1, int(omp)))
    shares_cores = generator_on_cpu and torch.device(trainer_device).type == "cpu" and not omp
    trainer_threads = max(1, cores - threads) if shares_cores else None
    lend = lend_idle_cores and trainer_threads is not None and cores > 1
    return Placement(device, threads, trainer_threads, cores=cores, lend_cores=lend)
