"""The check that every rank runs the same collectives, in the same order, with the same shapes.

**The rule** (docs/architecture.md, "Several processes"): every collective of the trainers and the engine
(`gather`, `reduce`, `all_reduce`, `broadcast`, barriers) runs on every rank, in the same order, with the same
shapes and dtypes. A rank's own data (where its batch came from, its age, what it evicted) may change what it
contributes to a collective, never whether it joins one. Broken, gloo and NCCL do not say so: a rank blocks
forever, or the transport fails with "Received data size doesn't match expected size" far from the call that
diverged.

torch's own checker (`TORCH_DISTRIBUTED_DEBUG=DETAIL`) would name the calls, but with torch 2.13.0's CPU build and
gloo it kills every rank with SIGSEGV at start-up, even for a stock `GRPOTrainer` script. So this module does what
it does, in a debug mode: with `TRL_ASYNC_CHECK_COLLECTIVES=1` in the environment, each collective first
all-gathers, over its own process group, a fixed-size fingerprint of itself (its number in this rank's sequence of
that group's collectives, the operation, the call site, the dtype and shape) and, where the ranks' fingerprints
differ, raises `CollectiveMismatchError` on every rank of the group, naming each rank's call and the call before it
(and, where every rank is at the same call with another shape, saying so). The fingerprint is always the same size,
so the check itself cannot fall out of step.

It intercepts the `torch.distributed` functions that accelerate, transformers and TRL call (module attributes,
looked up at each call), so it sees TRL's collectives as well as ours: a rank that skipped one of ours shows up
against TRL's next one. Each call's arguments are read by the function's own signature, so a group or `async_op`
passed by position counts as one passed by name. A collective on a sub-group is checked among that group's ranks
only (the others do not take part in it; a group of one rank has nothing to compare). Asynchronous collectives and
the ones DDP's reducer issues from C++ are passed through unchecked. Off by default: it costs one extra all-gather
per collective.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import os
import sys
import threading

import torch

ENV_VAR = "TRL_ASYNC_CHECK_COLLECTIVES"

# The torch.distributed functions checked, with a stable number for each (part of the fingerprint).
_OPERATIONS = (
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter_tensor",
)
# The parameter of each whose tensor must have the same shape and dtype on every rank: the input of a gather, the
# buffer of a reduce or a broadcast. None: object collectives and barriers, of which only the order is compared.
_TENSOR_PARAMETER = {
    "all_gather_into_tensor": "input_tensor",
    "all_gather": "tensor",
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "reduce_scatter_tensor": "input",
}
_FINGERPRINT_SIZE = 5  # seq, op, site, dtype, shape
# Frames of these packages are the plumbing between a call site and the collective, not the call site.
_PLUMBING = (
    os.sep + os.path.join("torch", "distributed") + os.sep,
    os.sep + "accelerate" + os.sep,
    __file__,
)


class CollectiveMismatchError(RuntimeError):
    """Two ranks reached different collectives (or the same one with different shapes) at the same point."""


def requested() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


class _Checker:
    def __init__(self):
        self.originals: dict[str, object] = {}
        # Per process group (None: the world), as each group's ranks must agree on its collectives alone: how many
        # this rank has checked, and its last calls, described.
        self.sequences: collections.Counter = collections.Counter()
        self.histories: collections.defaultdict = collections.defaultdict(lambda: collections.deque(maxlen=3))
        self.local = threading.local()  # set while a check's own collectives run

    # ------------------------------------------------------------------------------------------ install
    def install(self) -> None:
        import torch.distributed as dist

        # Every wrapper first: one may refuse torch's signature, and then none of the functions is replaced.
        wrappers = {
            name: self._checked(name, getattr(dist, name)) for name in _OPERATIONS if name not in self.originals
        }
        for name, wrapper in wrappers.items():
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.originals.clear()

    @property
    def installed(self) -> bool:
        return bool(self.originals)

    # ------------------------------------------------------------------------------------------ the check
    def _checked(self, name: str, original):
        signature = inspect.signature(original)  # torch's own (its logging decorators keep `__wrapped__`)
        tensor_parameter = _TENSOR_PARAMETER[name]
        for parameter in {"group", tensor_parameter} - {None}:  # read by name below: a rename must not go unseen
            if parameter not in signature.parameters:
                raise RuntimeError(
                    f"torch.distributed.{name}{signature} has no parameter {parameter!r}: the collective check "
                    "(trl_async.trainers.collectives) was written for torch 2.13's signatures."
                )

        @functools.wraps(original)
        def collective(*args, **kwargs):
            if not getattr(self.local, "inside", False):
                try:
                    arguments = signature.bind(*args, **kwargs).arguments  # positional and keyword alike
                except TypeError:
                    arguments = None  # a call torch refuses itself, below
                if arguments is not None and _checkable(arguments):
                    tensor = arguments.get(tensor_parameter) if tensor_parameter else None
                    group = arguments.get("group")
                    self.check(name, tensor if isinstance(tensor, torch.Tensor) else None, group)
            return original(*args, **kwargs)

        return collective

    def check(self, name: str, tensor: torch.Tensor | None, group=None) -> None:
        """Compare this call with the calls the other ranks of `group` (None: the world) are at."""
        import torch.distributed as dist

        key = None if group is None or group is dist.group.WORLD else group
        sequence, history = self.sequences[key], self.histories[key]
        site = _call_site()
        call = _Call(name, site, None if tensor is None else str(tensor.dtype), _shape(tensor))
        fingerprint = torch.zeros(_FINGERPRINT_SIZE, dtype=torch.int64)
        fingerprint[0] = sequence
        fingerprint[1] = _OPERATIONS.index(name)
        fingerprint[2] = _stable_hash(site)
        if tensor is not None:
            fingerprint[3] = _stable_hash(call.dtype)
            fingerprint[4] = _stable_hash(str(call.shape))  # every dimension: sizes, rank and order
        device = _collective_device(tensor, key)
        size = dist.get_world_size(key)
        self.local.inside = True
        try:
            parts = [torch.empty(_FINGERPRINT_SIZE, dtype=torch.int64, device=device) for _ in range(size)]
            self.originals["all_gather"](parts, fingerprint.to(device), group=key)
            gathered = torch.stack(parts).cpu()
            if not bool((gathered == gathered[0]).all()):
                # Every rank of the group sees the same gathered fingerprints, so every one gets here: the calls can
                # be exchanged (one more collective, on each of them alike) before each raises.
                calls = [None] * size
                self.originals["all_gather_object"](calls, (call, list(history)), group=key)
                ranks = list(range(size)) if key is None else dist.get_process_group_ranks(key)
                raise CollectiveMismatchError(_mismatch_message(sequence, dist.get_rank(), ranks, calls, key is None))
        finally:
            self.local.inside = False
        self.sequences[key] += 1
        history.append(call.described)


_CHECKER = _Checker()


def install_if_requested() -> bool:
    """Install the check when `TRL_ASYNC_CHECK_COLLECTIVES` asks for it (idempotent); True when it is on."""
    if requested() and not _CHECKER.installed:
        _CHECKER.install()
    return _CHECKER.installed


def install() -> None:
    _CHECKER.install()


def uninstall() -> None:
    _CHECKER.uninstall()


def checked_collectives() -> int:
    """How many collectives of the whole world this process has checked (0 when the check is off)."""
    return _CHECKER.sequences[None]


# ---------------------------------------------------------------------------------------------- helpers
class _Call(collections.namedtuple("_Call", "name site dtype shape")):
    """One rank's call as the ranks exchange it on a mismatch: the operation, the call site, and the dtype and shape
    of its tensor (None for object collectives and barriers)."""

    __slots__ = ()

    @property
    def tensor_described(self) -> str:
        return "no tensor" if self.shape is None else f"{self.dtype.replace('torch.', '')} {self.shape}"

    @property
    def what(self) -> str:
        return self.name if self.shape is None else f"{self.name} {self.tensor_described}"

    @property
    def described(self) -> str:
        return f"{self.what} at {self.site}"


def _checkable(arguments: dict) -> bool:
    """A synchronous collective of an initialised group of several ranks, this one among them (torch returns at once,
    doing nothing, on a rank outside the group)."""
    import torch.distributed as dist

    if arguments.get("async_op") or not (dist.is_available() and dist.is_initialized()):
        return False
    group = arguments.get("group")
    return dist.get_rank(group) >= 0 and dist.get_world_size(group) > 1


def _shape(tensor: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)


def _collective_device(tensor: torch.Tensor | None, group=None) -> torch.device:
    import torch.distributed as dist

    if tensor is not None:
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _call_site() -> str:
    """`path:line in function` of the nearest frame outside torch.distributed, accelerate and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in _PLUMBING):
            return f"{_short_path(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def _short_path(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "trl_async" + os.sep, os.sep + "tests" + os.sep):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail if marker.startswith("site") else marker.strip(os.sep) + os.sep + tail
    return os.path.basename(path)


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _mismatch_message(sequence: int, rank: int, ranks: list[int], calls: list, world: bool) -> str:
    """`calls`: each rank of the group's (`_Call`, its last calls described), in the group's order; `ranks`: their
    ranks in the world."""
    which = "of this run" if world else f"of this run on the process group of ranks {ranks}"
    lines = [f"The ranks reached different collectives (collective #{sequence} {which}; seen from rank {rank}):"]
    for other, (call, history) in zip(ranks, calls, strict=True):
        before = f" (after: {history[-1]})" if history else ""
        lines.append(f"  rank {other}: {call.described}{before}")
    if (
        len({(call.name, call.site) for call, _ in calls}) == 1
        and len({call.tensor_described for call, _ in calls}) > 1
    ):
        call = calls[0][0]
        tensors = ", ".join(f"{c.tensor_described} on rank {r}" for r, (c, _) in zip(ranks, calls, strict=True))
        lines.append(
            f"Every rank is at the same call, {call.name} at {call.site}, with a tensor of another shape or dtype: "
            f"{tensors}. A tensor sized by a rank's own data (its batch, its sequence lengths) must be brought to a "
            "shape the ranks agree on (padded to the maximum over the ranks, say) before the collective."
        )
    lines.append(
        "Every rank must run every collective, in the same order and with the same shapes, whatever its own batch "
        "(docs/architecture.md, 'Several processes')."
    )
    return "\n".join(lines)


__all__ = [
    "ENV_VAR",
    "CollectiveMismatchError",
    "checked_collectives",
    "install",
    "install_if_requested",
    "requested",
    "uninstall",
]
