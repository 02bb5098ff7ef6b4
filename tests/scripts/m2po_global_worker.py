"""One rank of the 2-process global M2PO test (tests/test_losses_global.py).

    python tests/scripts/m2po_global_worker.py RANK WORLD INIT_FILE OUT_DIR

Loads the package trl_async/algorithms/m2po/ and the cases by path (trl_async's __init__ imports TRL, which takes long
on a busy machine and is not needed here), joins a gloo process group through INIT_FILE, runs ``m2po_select_global``
on its part of every case (also on the accelerator branch, its host syncs counted by tests/support/host_syncs.py), and
saves what it got to OUT_DIR/rank<RANK>.pt.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    """A module (a .py file) or a package (a folder: its relative imports resolve inside it) loaded by path."""
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    losses = _load("m2po_losses_under_test", HERE.parents[1] / "trl_async" / "algorithms" / "m2po")
    cases = _load("m2po_global_cases", HERE / "m2po_global_cases.py")
    host_syncs = _load("host_syncs", HERE.parent / "support" / "host_syncs.py")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = []
        for case in range(cases.N_CASES):
            (delta, mask, adv), rule, tau, (low, high) = cases.make_case(case, rank)
            sel = losses.m2po_select_global(delta, mask, tau, adv, rule, clip_floor_low=low, clip_floor_high=high)
            sels = sel if isinstance(sel, list) else [sel]
            record = {
                "keep": [s.keep.clone() for s in sels],
                "sums": [s.stats["sums"].clone() for s in sels],
                "clip": [
                    None if s.clip_log_high is None else (s.clip_log_low.item(), s.clip_log_high.item()) for s in sels
                ],
            }
            # The accelerator branch (sizes from the header, nonzero_static), run on CPU, its host syncs counted.
            with host_syncs.count_host_syncs() as syncs:
                sel_acc = losses.m2po_select_global(
                    delta, mask, tau, adv, rule, clip_floor_low=low, clip_floor_high=high, host_memory=False
                )
            record["host_syncs_accelerator_branch"] = (syncs.count, syncs.report())
            record["keep_accelerator_branch"] = [
                s.keep.clone() for s in (sel_acc if isinstance(sel_acc, list) else [sel_acc])
            ]
            if case == 0:  # the loss with a global selection: gradient only where kept
                logp = delta.clone().requires_grad_()
                loss, _ = losses.m2po_loss(logp, torch.zeros_like(delta), adv, mask, selection=sel)
                loss.backward()
                record["grad_zero"] = logp.grad == 0
            results.append(record)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
