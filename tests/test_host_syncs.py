"""The host-sync counter (`tests/support/host_syncs.py`) itself: it must see each kind of sync, once, and nothing in
pure tensor math, or the sync counts asserted with it (M2PO, the rewards, the correction) would prove nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.host_syncs import count_host_syncs


def _data():
    t = torch.arange(12.0).reshape(3, 4)
    return t, t > 4.5


SYNCS = {
    "item": lambda t, m: t.sum().item(),
    "bool": lambda t, m: bool(m.any()),
    "int": lambda t, m: int(t[0, 1]),
    "float": lambda t, m: float(t.max()),
    "format": lambda t, m: f"{t[0, 0]:.2f}",
    "index_with_a_0dim_int_tensor": lambda t, m: t.reshape(-1)[torch.argmax(t)],
    "tolist": lambda t, m: t.tolist(),
    "numpy": lambda t, m: t.numpy(),
    "np.asarray": lambda t, m: np.asarray(t),
    "cpu": lambda t, m: t.cpu(),
    "to_cpu": lambda t, m: t.to("cpu"),
    "to_cpu_and_dtype": lambda t, m: t.to(device="cpu", dtype=torch.float64),
    "nonzero": lambda t, m: m.nonzero(),
    "nonzero_as_tuple": lambda t, m: m.nonzero(as_tuple=True),
    "where_one_argument": lambda t, m: torch.where(m),
    "argwhere": lambda t, m: torch.argwhere(m),
    "masked_select": lambda t, m: t.masked_select(m),
    "bool_mask_index": lambda t, m: t[m],
    "unique": lambda t, m: torch.unique(t),
    "unique_consecutive": lambda t, m: torch.unique_consecutive(t),
    "repeat_interleave": lambda t, m: torch.repeat_interleave(m.sum(dim=1)),
    "bincount": lambda t, m: torch.bincount(m.sum(dim=1)),
    "histc_without_range": lambda t, m: torch.histc(t),
    "equal": lambda t, m: torch.equal(t, t),
    "allclose": lambda t, m: torch.allclose(t, t),
    "tensor_uploaded": lambda t, m: torch.tensor([1.0, 2.0], device=t.device),
    "as_tensor_uploaded": lambda t, m: torch.as_tensor([1.0, 2.0], device=t.device),
    "new_tensor": lambda t, m: t.new_tensor([1.0, 2.0]),
    "element_set_to_a_number": lambda t, m: t.reshape(-1).__setitem__(3, 1.0),
    "index_set_to_a_number": lambda t, m: t.reshape(-1).__setitem__(torch.argsort(t.reshape(-1))[:2], 1.0),
    "mask_set_to_device_value": lambda t, m: t.__setitem__(m, t[0, 0]),
    "host_to_device": lambda t, m: torch.tensor([1.0, 2.0]).to(t.device),
    "copy_of_host_into_device": lambda t, m: t[0].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0])),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_kind_of_sync_counts_once(name):
    t, m = _data()
    with count_host_syncs() as syncs:
        SYNCS[name](t, m)
    assert syncs.count == 1, syncs.report()
    assert "test_host_syncs.py" in syncs.events[0].where  # the caller is named, not a torch frame


def test_pure_tensor_math_counts_zero():
    # What the sync-free code paths are made of: reductions, masks as arithmetic, sort / topk, nonzero_static, integer
    # indexing, index_fill, torch.where with three arguments, masked_fill, cumsum, casts, host numbers as scalars.
    t, m = _data()
    with count_host_syncs() as syncs:
        flat = t.reshape(-1)
        s = torch.where(m, t, 0.0).sum(dtype=torch.float64) + m.sum() * 2.0
        order = torch.sort(flat, descending=True).indices
        top = torch.topk(flat, 3)
        idx = torch.nonzero_static(m.reshape(-1), size=5).squeeze(1)
        picked = flat[idx] + flat[order[:2]].sum()
        filled = flat.index_fill(0, top.indices, 0.0).masked_fill(m.reshape(-1), 1.0)
        k = torch.argmax((flat.cumsum(0) > 10).to(torch.uint8))
        chosen = torch.gather(flat, 0, k.reshape(1))
        full = torch.full((), 0.5, device=t.device) * torch.stack([s, picked.sum(), filled.sum(), chosen[0]]).double()
        torch.exp(full).clamp(max=3.0).to(torch.float16).float().sum()
        x = t.clone().requires_grad_()
        (torch.exp(x) * m).sum().backward()
    assert syncs.count == 0, syncs.report()


FREE = {
    # aten turns these into masked_fill_ / fill_ with the host number, or never leaves host memory.
    "mask_set_to_a_number": lambda t, m: t.__setitem__(m, 0.0),
    "slice_set_to_a_number": lambda t, m: t.reshape(-1).__setitem__(slice(1, 3), 0.0),
    "host_data_read": lambda t, m: (torch.tensor([1.0, 2.0]) * 2).sum().item(),
    "host_numpy_data_read": lambda t, m: torch.from_numpy(np.ones(3))[0].item(),
    "non_blocking_upload": lambda t, m: torch.tensor([1.0, 2.0]).to(t.device, non_blocking=True),
    "move_device_data_to_its_device": lambda t, m: t.to(device=t.device, dtype=torch.float64),
    "len_and_shape": lambda t, m: len(t) + t.shape[0] + t.numel(),
}


@pytest.mark.parametrize("name", list(FREE))
def test_what_waits_for_nothing_counts_zero(name):
    t, m = _data()
    with count_host_syncs() as syncs:
        FREE[name](t, m)
    assert syncs.count == 0, syncs.report()


def test_a_copy_read_twice_counts_once():
    t, _ = _data()
    with count_host_syncs() as syncs:
        host = t.sum(dim=1).cpu()  # the sync
        values = host.numpy()
        first = host[0].item()
    assert syncs.count == 1, syncs.report()
    assert values.tolist() == [6.0, 22.0, 38.0] and first == 6.0


def test_reading_results_after_the_block_is_not_counted():
    t, _ = _data()
    with count_host_syncs() as syncs:
        total = t.sum()
    assert total.item() == 66.0 and t.tolist()[0] == [0.0, 1.0, 2.0, 3.0]
    assert syncs.count == 0
    assert "tolist" not in torch.Tensor.__dict__  # the wrappers are gone


def test_a_count_names_each_sync_and_where_it_happened():
    t, m = _data()
    with count_host_syncs() as syncs:
        t.sum().item()
        t[m].sum()
    assert syncs.count == 2
    assert "_local_scalar_dense" in syncs.events[0].what and "nonzero" in syncs.events[1].what
    assert "test_a_count_names_each_sync_and_where_it_happened" in syncs.report()
