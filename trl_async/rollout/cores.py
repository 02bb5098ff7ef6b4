"""Lending a rank's CPU cores to whichever of its two processes is working.

On a CPU the trainer and its generation process share the rank's cores, split by `placement` (each keeps a share, so
that neither oversubscribes the other: an OpenMP region waits for its slowest thread, and a thread whose core runs the
other process is slow). A fixed split wastes the share of a process that waits: the generator waits at the staleness
gate whenever it is ahead, the trainer waits on the queue whenever generation is the bottleneck. Training a batch on
two threads takes about 0.6 of the time it takes on one (measured on the bundled model), so the trainer's idle share is
worth lending.

Each process publishes one flag, "I am waiting", written by that process only (no lock: a flag read one layer late
costs one layer run on the old thread count). Each process re-reads the other's flag at the points where its work is
cut into short pieces: before every layer's forward and before every layer's backward (the trainer), before every
decoding step (the generator), and sets its torch thread count to every core of the rank while the other waits, its
own share otherwise. `torch.set_num_threads` is cheap (measured: a thread-count switch before each of 2,000 small
matmuls added nothing measurable) and is only called when the count changes.
"""

from __future__ import annotations

import torch

TRAINER, GENERATOR = 0, 1


class CoreLending:
    """Shared waiting flags of one rank's trainer and generator, and the thread count each may use right now.

    Pickled into the generation process (the flags are shared memory, created before the spawn).
    """

    def __init__(self, ctx, cores: int, trainer_threads: int, generator_threads: int):
        self.cores = cores
        self.shares = (trainer_threads, generator_threads)
        self._waiting = ctx.RawArray("b", 2)  # [trainer waits on the queue, generator waits at the gate]
        self._threads = None  # this process's current torch thread count, as last set here
        self.lent_calls = 0  # hook calls that found the other process waiting (for metrics)
        self.calls = 0

    def __getstate__(self):
        return {"cores": self.cores, "shares": self.shares, "_waiting": self._waiting}

    def __setstate__(self, state):
        self.__dict__.update(state, _threads=None, lent_calls=0, calls=0)

    def threads_for(self, side: int) -> int:
        """Every core while the other process waits, this side's share otherwise."""
        return self.cores if self._waiting[1 - side] else self.shares[side]

    def apply(self, side: int) -> None:
        threads = self.threads_for(side)
        self.calls += 1
        if threads > self.shares[side]:
            self.lent_calls += 1
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def set_waiting(self, side: int, waiting: bool) -> None:
        self._waiting[side] = 1 if waiting else 0

    def attach(self, model: torch.nn.Module, side: int) -> list:
        """Re-read the other side's flag before each layer's forward and backward of `model`; return the hook handles
        (`remove()` them to detach)."""
        layers = _layers(model)

        def before_backward(grad):
            self.apply(side)

        def before_forward(module, args):
            self.apply(side)

        def after_forward(module, args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(before_backward)  # fires when this layer's backward is about to run

        handles = [model.register_forward_pre_hook(before_forward)]
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(before_forward))
            handles.append(layer.register_forward_hook(after_forward))
        return handles


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model: the members of its largest `ModuleList` (a transformer's decoder layers)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
