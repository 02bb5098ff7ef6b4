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
all-gathers a fixed-size fingerprint of itself (its number in this rank's sequence, the operation, the call site,
the dtype and shape) and, where the ranks' fingerprints differ, raises `CollectiveMismatchError` on every rank,
naming each rank's call and the call before it. The fingerprint is always the same size, so the check itself
cannot fall out of step.

It intercepts the `torch.distributed` functions that accelerate, transformers and TRL call (module attributes,
looked up at each call), so it sees TRL's collectives as well as ours: a rank that skipped one of ours shows up
against TRL's next one. Collectives on a sub-group, asynchronous ones and the ones DDP's reducer issues from C++
are passed through unchecked. Off by default: it costs one extra all-gather per collective.
"""

from __future__ import annotations

import collections
import functools
import hashlib
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
_MAX_DIMS = 4  # shapes are compared on their first dimensions, their rank and their element count
# seq, op, site, dtype, ndim, numel, dims...
_FINGERPRINT_SIZE = 6 + _MAX_DIMS
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
        self.sequence = 0
        self.history: collections.deque[str] = collections.deque(maxlen=3)  # this rank's last calls, described
        self.local = threading.local()  # set while a check's own collectives run

    # ------------------------------------------------------------------------------------------ install
    def install(self) -> None:
        import torch.distributed as dist

        for name in _OPERATIONS:
            if name in self.originals:
                continue
            original = getattr(dist, name)
            self.originals[name] = original
            setattr(dist, name, self._checked(name, original))

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
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if not getattr(self.local, "inside", False) and self._checkable(kwargs):
                self.check(name, _first_tensor(name, args, kwargs))
            return original(*args, **kwargs)

        return collective

    @staticmethod
    def _checkable(kwargs) -> bool:
        import torch.distributed as dist

        if kwargs.get("async_op") or kwargs.get("group") not in (None, dist.group.WORLD):
            return False
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def check(self, name: str, tensor: torch.Tensor | None) -> None:
        import torch.distributed as dist

        site = _call_site()
        described = _describe(name, tensor, site)
        fingerprint = torch.zeros(_FINGERPRINT_SIZE, dtype=torch.int64)
        fingerprint[0] = self.sequence
        fingerprint[1] = _OPERATIONS.index(name)
        fingerprint[2] = _stable_hash(site)
        if tensor is not None:
            shape = list(tensor.shape)
            fingerprint[3] = _stable_hash(str(tensor.dtype))
            fingerprint[4] = len(shape)
            fingerprint[5] = tensor.numel()
            for i, size in enumerate(shape[:_MAX_DIMS]):
                fingerprint[6 + i] = size
        device = _collective_device(tensor)
        world = dist.get_world_size()
        self.local.inside = True
        try:
            parts = [torch.empty(_FINGERPRINT_SIZE, dtype=torch.int64, device=device) for _ in range(world)]
            self.originals["all_gather"](parts, fingerprint.to(device))
            gathered = torch.stack(parts).cpu()
            if not bool((gathered == gathered[0]).all()):
                # Every rank sees the same gathered fingerprints, so every rank gets here: the descriptions can be
                # exchanged (one more collective, on every rank alike) before each rank raises.
                descriptions = [None] * world
                self.originals["all_gather_object"](descriptions, (described, list(self.history)))
                raise CollectiveMismatchError(_mismatch_message(self.sequence, dist.get_rank(), descriptions))
        finally:
            self.local.inside = False
        self.sequence += 1
        self.history.append(described)


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
    """How many collectives this process has checked (0 when the check is off)."""
    return _CHECKER.sequence


# ---------------------------------------------------------------------------------------------- helpers
def _first_tensor(name: str, args, kwargs) -> torch.Tensor | None:
    """The tensor whose shape and dtype must agree across ranks: the input of a gather, the buffer of a reduce or a
    broadcast; None for object collectives and barriers (only their order is checked)."""
    if name in ("barrier", "all_gather_object", "broadcast_object_list"):
        return None
    if name in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"):
        tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("tensor", kwargs.get("input")))
    else:
        tensor = args[0] if args else kwargs.get("tensor")
    return tensor if isinstance(tensor, torch.Tensor) else None


def _collective_device(tensor: torch.Tensor | None) -> torch.device:
    import torch.distributed as dist

    if tensor is not None:
        return tensor.device
    if dist.get_backend() == "nccl":
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


def _describe(name: str, tensor: torch.Tensor | None, site: str) -> str:
    what = name if tensor is None else f"{name} {str(tensor.dtype).replace('torch.', '')} {tuple(tensor.shape)}"
    return f"{what} at {site}"


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _mismatch_message(sequence: int, rank: int, descriptions: list) -> str:
    lines = [f"The ranks reached different collectives (collective #{sequence} of this run; seen from rank {rank}):"]
    for other, (described, history) in enumerate(descriptions):
        before = f" (after: {history[-1]})" if history else ""
        lines.append(f"  rank {other}: {described}{before}")
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
