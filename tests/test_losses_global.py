"""Global M2PO selection with two real processes (gloo on CPU): ``m2po_select_global`` on each rank's tokens equals
``m2po_select`` over the concatenation of both ranks' tokens (rank 0 first, each flattened row-major), for every
rule, with uneven sizes, ties across ranks, an empty rank, a rank without candidates, NaN, and micro-batch lists.

The ranks are two processes running tests/scripts/m2po_global_worker.py; the cases are in
tests/scripts/m2po_global_cases.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trl_async.algorithms.m2po import m2po_loss, m2po_select, m2po_select_global

SCRIPTS = Path(__file__).resolve().parent / "scripts"
_spec = importlib.util.spec_from_file_location("m2po_global_cases", SCRIPTS / "m2po_global_cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
WORLD, N_CASES, make_case = cases.WORLD, cases.N_CASES, cases.make_case


def _flat_concat(parts, key):
    out = []
    for p in parts:
        out += [t.reshape(-1) for t in p[key]]
    return torch.cat(out)


@pytest.fixture(scope="module")
def global_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("m2po_global")
    init_file = out_dir / "init"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "m2po_global_worker.py"), str(r), str(WORLD), str(init_file), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def _single_process(case):
    parts = []
    for rank in range(WORLD):
        (delta, mask, adv), rule, tau, floors = make_case(case, rank)
        deltas, masks, advs = (delta, mask, adv) if isinstance(delta, list) else ([delta], [mask], [adv])
        advs = [(a.unsqueeze(1) if a.dim() == 1 else a).expand(d.shape) for a, d in zip(advs, deltas, strict=True)]
        masks = [m.expand(d.shape) for m, d in zip(masks, deltas, strict=True)]
        parts.append({"delta": deltas, "mask": masks, "adv": advs})
    flat = [_flat_concat(parts, k) for k in ("delta", "mask", "adv")]
    return rule, m2po_select(*flat[:2], tau, flat[2], rule, clip_floor_low=floors[0], clip_floor_high=floors[1])


@pytest.mark.parametrize("case", range(N_CASES))
def test_global_selection_equals_single_process_over_the_concatenation(global_results, case):
    rule, single = _single_process(case)
    got = torch.cat([k.reshape(-1) for r in range(WORLD) for k in global_results[r][case]["keep"]])
    assert got.tolist() == single.keep.tolist()
    acc = torch.cat([k.reshape(-1) for r in range(WORLD) for k in global_results[r][case]["keep_accelerator_branch"]])
    assert acc.tolist() == single.keep.tolist()
    # The stats are local (per rank and micro-batch); summed they are the single-process figures, except the
    # all-masked count, which counts every micro-batch that had valid tokens and kept none.
    per_part = [s for r in range(WORLD) for s in global_results[r][case]["sums"]]
    total = sum(per_part)
    # Counts exactly; delta^2 sums up to float32 rounding (some single-process stats use a float32 dot).
    assert total[:4].tolist() == single.stats["sums"][:4].tolist()
    torch.testing.assert_close(total[4:-1], single.stats["sums"][4:-1], rtol=1e-6, atol=1e-9, equal_nan=True)
    assert total[-1].item() == sum(float(s[0] > 0 and s[1] == 0) for s in per_part)
    if rule == "authors_code" and single.clip_log_high is not None:
        for r in range(WORLD):
            for low, high in global_results[r][case]["clip"]:
                assert low == pytest.approx(single.clip_log_low.item())
                assert high == pytest.approx(single.clip_log_high.item())
    # Each case exercises what it is meant to.
    n_valid, n_kept = int(single.stats["sums"][0]), int(single.stats["sums"][1])
    if case in (0, 1, 2, 3, 4, 5, 12, 14, 15, 16):
        assert 0 < n_kept < n_valid, "the case should mask some tokens but not all"
    if case in (11, 13):
        assert n_kept == 0 < n_valid and single.stats["all_masked"]
    if case == 14:
        assert [len(global_results[r][case]["keep"]) for r in range(WORLD)] == [2, 3]


@pytest.mark.parametrize("case", range(N_CASES))
def test_global_selection_makes_at_most_one_host_sync(global_results, case):
    # Reading the header (it sizes the second all_gather) is the one sync of the accelerator branch, on every rank
    # (the worker counts them with tests/support/host_syncs.py).
    for rank in range(WORLD):
        count, report = global_results[rank][case]["host_syncs_accelerator_branch"]
        assert count <= 1, f"rank {rank}:\n{report}"


def test_global_selection_differs_from_per_rank_selection(global_results):
    # The point of the scope: selecting per rank would give another mask on these cases.
    differs = 0
    for case in (0, 1, 3, 4, 16):
        for rank in range(WORLD):
            (delta, mask, adv), rule, tau, _ = make_case(case, rank)
            local = m2po_select(delta, mask, tau, adv, rule).keep
            differs += not torch.equal(local, global_results[rank][case]["keep"][0])
    assert differs > 0


def test_loss_with_global_selection_has_gradient_exactly_on_kept_tokens(global_results):
    for rank in range(WORLD):
        (delta, mask, adv), *_ = make_case(0, rank)
        keep = global_results[rank][0]["keep"][0]
        a = adv.unsqueeze(1).expand(delta.shape)
        assert torch.equal(global_results[rank][0]["grad_zero"], ~keep | (a == 0))
    # And the same loss in this process, from a selection made here, agrees on what has gradient.
    (delta, mask, adv), rule, tau, _ = make_case(0, 0)
    logp = delta.clone().requires_grad_()
    loss, _ = m2po_loss(logp, torch.zeros_like(delta), adv, mask, selection=m2po_select(delta, mask, tau, adv, rule))
    loss.backward()
    assert torch.equal(logp.grad != 0, m2po_select(delta, mask, tau, adv, rule).keep & (adv.unsqueeze(1) != 0))


def test_single_rank_without_process_group_is_m2po_select():
    (delta, mask, adv), rule, tau, _ = make_case(0, 0)
    assert not dist.is_initialized()
    sel = m2po_select_global(delta, mask, tau, adv, rule)
    assert torch.equal(sel.keep, m2po_select(delta, mask, tau, adv, rule).keep)
    (deltas, masks, advs), *_ = make_case(14, 1)
    pieces = m2po_select_global(deltas, masks, tau, advs, "paper")
    assert [p.keep.shape for p in pieces] == [d.shape for d in deltas]
    whole = m2po_select(
        torch.cat([d.reshape(-1) for d in deltas]),
        torch.cat([m.reshape(-1) for m in masks]),
        tau,
        torch.cat([a.unsqueeze(1).expand(d.shape).reshape(-1) for a, d in zip(advs, deltas, strict=True)]),
        "paper",
    )
    assert torch.cat([p.keep.reshape(-1) for p in pieces]).tolist() == whole.keep.tolist()
