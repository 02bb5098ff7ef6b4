"""Host syncs counted on the CPU: the operations that would make the host wait for an accelerator.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`), an op whose output size
depends on the data (`nonzero`, boolean-mask indexing, `unique`, ...) and a blocking copy of host data to the device
(`torch.tensor(data, device=...)`, `t[i] = 1.0`) each wait for the device's queue to drain; PyTorch's
`torch.cuda.set_sync_debug_mode` flags them (c10's `warn_or_error_on_sync`: `_local_scalar_dense`, `nonzero`, and every
copy between host and device that is not `non_blocking`). On a CPU nothing waits, so CI cannot see them happen; this
counter sees the operations themselves, so code run on CPU tensors shows how many syncs it would cost on a GPU.

**Host data.** Every tensor is a CPU tensor here, so the counter tells the tensors that would live in host memory on a
GPU from those that would live on the device: host data is what was made from Python data (`torch.tensor` without a
device, `torch.from_numpy`, the values of `t[i] = 1.0`: aten's `lift_fresh`), what `.cpu()` / `.to("cpu")` returned,
and what an op computed from host data alone. Everything else is device data (factories too: `torch.zeros(n)` and
`torch.zeros(n, device=x.device)` look the same here). Reading host data is free.

**What counts**, as one sync each:

* reading device data: `_local_scalar_dense` (what `.item()`, `bool(t)`, `int(t)`, `float(t)`, `f"{t:.2f}"` and indexing
  with a 0-dim integer tensor dispatch), `.tolist()`, `.numpy()` (so `np.asarray(t)`), `.cpu()`, `.to("cpu")`;
* ops whose output size depends on the data: `nonzero` (also `torch.where(c)`, `argwhere`, `nonzero(as_tuple=True)`),
  `masked_select`, `index` with a boolean index, `index_put_` with a boolean index (unless it is PyTorch's masked-fill
  case: one mask and one host value), the `unique` family, `repeat_interleave` without `output_size`;
* ops that read a value internally: `bincount`, `histc` without a range, `equal`, `allclose`;
* blocking copies of host data to the device: `torch.tensor` / `torch.as_tensor` of Python data with `device=`,
  `Tensor.new_tensor`, `host.to(<a torch.device>)` without `non_blocking`, `copy_` between host and device data
  (`t[i] = 1.0` is a `copy_` from a host scalar), `index_put_` of a host scalar (`t[idx] = 1.0`: aten moves the value to
  the device first).

A Python-level call counts once: the ops it dispatches inside are not counted again.

Not counted, because PyTorch's CUDA kernels do not wait: `nonzero_static` (its size is given), `topk`, `sort`,
`masked_fill`, `masked_scatter`, `torch.where(c, a, b)`, `index_fill`, indexing with an integer tensor, a slice
assignment of a number (`fill_` of a host scalar), reductions, `torch.full` with a number, a `non_blocking` copy.
Not visible: collectives, and a `.to(x.device)` of device data (a no-op on a GPU, a no-op here).

Usage, for code with an accelerator path that a CPU run can force (`host_memory=False` in `algorithms.m2po`):

    with count_host_syncs() as syncs:
        m2po_mask(delta, mask, 0.04, adv, host_memory=False)
    assert syncs.count <= 1, syncs.report()

The counter is tested in `tests/test_host_syncs.py`: each kind counts once, pure tensor math and host data zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Ops whose CUDA kernel waits for the device whatever their arguments (when their input is device data).
SYNCING_OPS = {
    aten._local_scalar_dense.default: "read a value (.item(), bool(t), int(t), float(t), t[0-dim int tensor])",
    aten.nonzero.default: "nonzero (its output size depends on the data)",
    aten.masked_select.default: "masked_select (its output size depends on the data)",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount (reads the maximum)",
    aten.equal.default: "torch.equal",
    aten.allclose.default: "torch.allclose",
}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclasses.dataclass(frozen=True)
class HostSync:
    what: str  # the op or method, and why it waits
    where: str  # the first caller outside torch and this module, "file:line in function"
    path: str  # that caller's file, absolute (`HostSyncCounter.made_by` selects on it)


class HostSyncCounter:
    """The syncs seen while active (see the module docstring): `count`, `events`, `report()`."""

    def __init__(self):
        self.events: list[HostSync] = []
        self._depth = 0  # > 0 inside a wrapped Python-level call: what it dispatches is already counted
        self._thread = threading.get_ident()
        self._host: dict[int, torch.Tensor] = {}  # storage address -> a tensor keeping it alive (no address reuse)

    @property
    def count(self) -> int:
        return len(self.events)

    def reset(self) -> None:
        self.events.clear()

    def report(self, events: list[HostSync] | None = None) -> str:
        events = self.events if events is None else events
        return "\n".join(f"{e.what}  at {e.where}" for e in events) or "no host sync"

    def made_by(self, package_dir: str) -> list[HostSync]:
        """The syncs whose first caller outside torch is a file under `package_dir` (e.g. trl_async's own, in a step
        that also runs TRL's and transformers' code)."""
        root = os.path.join(os.path.abspath(package_dir), "")
        return [e for e in self.events if e.path.startswith(root)]

    # ---------------------------------------------------------------------------------------------------- host data
    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._host

    def _mark(self, tensor: torch.Tensor, host: bool) -> None:
        address = tensor.untyped_storage().data_ptr()
        if host and address:
            self._host[address] = tensor
        elif not host:
            self._host.pop(address, None)

    def _record(self, what: str) -> None:
        if self._depth == 0:
            self.events.append(HostSync(what, *_caller()))

    # --------------------------------------------------------------------------------------- Python-level wrappers
    def _wrap(self, real, handler):
        counter = self

        def wrapper(*args, **kwargs):
            if threading.get_ident() != counter._thread:
                return real(*args, **kwargs)
            counter._depth += 1
            try:
                result = real(*args, **kwargs)
            finally:
                counter._depth -= 1
            return handler(result, *args, **kwargs)

        return wrapper

    def _read(self, what):
        """`.tolist()`, `.numpy()`: one read of device data."""

        def handler(result, tensor, *args, **kwargs):
            if not self.is_host(tensor):
                self._record(what)
            return result

        return handler

    def _to_host(self, what):
        """`.cpu()`: a read of device data; the copy is host data (a fresh one: a CPU tensor's `.cpu()` is itself)."""

        def handler(result, tensor, *args, **kwargs):
            if self.is_host(tensor):
                return result
            self._record(what)
            result = result.clone() if result is tensor else result
            self._mark(result, host=True)
            return result

        return handler

    def _to(self, result, tensor, *args, **kwargs):
        """`.to(...)`: `.to("cpu")` reads device data; `host.to(<torch.device>)` uploads host data."""
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None:
            return result
        spelled = [a for a in (*args, kwargs.get("device")) if isinstance(a, str)]
        if spelled and device.type == "cpu":
            return self._to_host("Tensor.to('cpu')")(result, tensor)
        if self.is_host(tensor) and not spelled:
            if not non_blocking:
                self._record("host.to(device): a blocking upload")
            result = result.clone() if result is tensor else result
            self._mark(result, host=False)
        return result

    def _upload(self, what):
        """Python data put on a device: a blocking copy; the result is device data."""

        def handler(result, data, *args, **kwargs):
            device = kwargs.get("device", args[1] if len(args) > 1 else None)  # as_tensor(data, dtype, device)
            if isinstance(data, torch.Tensor) or device is None:
                return result  # a tensor stays where it is; without a device the result is host data
            self._record(what)
            self._mark(result, host=False)
            return result

        return handler

    def _new_tensor(self, result, tensor, data, *args, **kwargs):
        if not isinstance(data, torch.Tensor) and not self.is_host(tensor):  # new host data next to device data
            self._record("Tensor.new_tensor(host data): a blocking upload")
            self._mark(result, host=False)
        return result

    def _patches(self):
        return [
            (torch.Tensor, "tolist", self._read("Tensor.tolist()")),
            (torch.Tensor, "numpy", self._read("Tensor.numpy()")),
            (torch.Tensor, "cpu", self._to_host("Tensor.cpu()")),
            (torch.Tensor, "to", self._to),
            (torch, "tensor", self._upload("torch.tensor(host data, device=...): a blocking upload")),
            (torch, "as_tensor", self._upload("torch.as_tensor(host data, device=...): a blocking upload")),
            (torch.Tensor, "new_tensor", self._new_tensor),
        ]


class _SyncDispatchMode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        why = _why_it_waits(func, args, kwargs, counter)
        if why is not None:
            counter._record(f"{func.__name__}: {why}")
        out = func(*args, **kwargs)
        host = func is aten.lift_fresh.default or (inputs and all(counter.is_host(t) for t in inputs))
        if host and func not in _INDEX_PUT and func is not aten.copy_.default:  # in-place ops keep their target's kind
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    counter._mark(t, host=True)
        return out


def _why_it_waits(func, args, kwargs, counter: HostSyncCounter) -> str | None:
    """Why this aten call waits for the device on a GPU, or None."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is not None and counter.is_host(first) and func is not aten.copy_.default and func not in _INDEX_PUT:
        return None  # host data: computing on it or reading it waits for nothing
    if func in SYNCING_OPS:
        return SYNCING_OPS[func]
    if func is aten.index.Tensor:
        return "index with a boolean mask (calls nonzero)" if any(_is_mask(i) for i in args[1]) else None
    if func in _INDEX_PUT:
        return _index_put_waits(args, counter)
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if counter.is_host(dst) != counter.is_host(src):
            return "a blocking copy between host and device data (t[i] = number is one)"
        return None
    if func in _REPEAT_INTERLEAVE:
        return None if kwargs.get("output_size") is not None else "repeat_interleave without output_size"
    if func is aten.histc.default:
        low = kwargs.get("min", args[2] if len(args) > 2 else 0)
        high = kwargs.get("max", args[3] if len(args) > 3 else 0)
        return "histc without a range (reads min and max)" if low == high else None
    return None


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _index_put_waits(args, counter: HostSyncCounter) -> str | None:
    """aten's `index_put_`: one mask and one host value -> `masked_fill_` (no wait); another mask -> nonzero; a host
    scalar value -> moved to the device first (`value.to(self.device())`, blocking)."""
    indices, value = args[1], args[2]
    masks = [i for i in indices if _is_mask(i)]
    host_value = counter.is_host(value)
    if masks:
        single = len(masks) == 1 and len([i for i in indices if i is not None]) == 1
        if single and host_value and value.numel() == 1:
            return None
        return "index_put_ with a boolean mask (calls nonzero)"
    if host_value and value.dim() == 0:
        return "index_put_ of a host scalar (t[idx] = number): moved to the device first, blocking"
    return None


def _caller() -> tuple[str, str]:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path != _HERE and not path.startswith(os.path.join(_TORCH_DIR, "")):
            return f"{os.path.relpath(path)}:{frame.lineno} in {frame.name}", path
    return "?", "?"


@contextlib.contextmanager
def count_host_syncs():
    """Count the host syncs of the code run inside (on this thread). Yields the `HostSyncCounter`."""
    counter = HostSyncCounter()
    saved = []
    try:
        for owner, name, handler in counter._patches():
            saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, counter._wrap(getattr(owner, name), handler))
        with _SyncDispatchMode(counter):
            yield counter
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
