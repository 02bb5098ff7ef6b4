"""Publishing policy weights from the trainer to the generation process through shared memory.

The trainer owns a set of CPU tensors in shared memory, one per published parameter. Publishing copies the current
parameters into them; the generator copies them into its own model between generation batches, never mid-sequence.

Torn reads are prevented with a sequence lock: the writer makes the sequence odd, copies, then makes it even again
and records the version. A reader copies only between two equal even sequence values and retries otherwise, so it
never applies a half-written mix of two versions, and the writer (the trainer) never waits for the reader.

Which tensors travel: the *trainable* parameters. For a full fine-tune that is every parameter; for a PEFT model it is
only the adapter tensors, so a LoRA sync moves a few MB whatever the size of the frozen base. The frozen parameters
travel once, at start-up, in a separate store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.multiprocessing as torch_mp


class SharedWeightStore:
    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], mp_context="spawn"):
        ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.empty(t.shape, dtype=t.dtype, device="cpu").share_memory_() for name, t in named_tensors
        }
        self._sequence = ctx.Value("q", 0)
        self._version = ctx.RawValue("q", -1)
        self._cond = ctx.Condition()

    @property
    def names(self) -> list[str]:
        return list(self.buffers)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    @property
    def version(self) -> int:
        return self._version.value

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy `named_tensors` (any device) into shared memory and mark them as `version`."""
        named_tensors = dict(named_tensors)
        missing = set(self.buffers) - set(named_tensors)
        if missing:
            raise KeyError(f"publish() is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        with self._sequence.get_lock():
            self._sequence.value += 1  # odd: write in progress
        with torch.no_grad():
            for name, buffer in self.buffers.items():
                buffer.copy_(named_tensors[name].detach())
        with self._sequence.get_lock():
            self._version.value = version
            self._sequence.value += 1  # even: consistent
        with self._cond:
            self._cond.notify_all()

    def wait_for_version(
        self, min_version: int, timeout: float | None = None, on_wait: Callable[[], None] | None = None
    ) -> int:
        """Block until weights of at least `min_version` are published; return the published version."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cond:
            while self._version.value < min_version:
                if deadline is not None and time.perf_counter() >= deadline:
                    raise TimeoutError(f"weights v{min_version} were not published in time (have v{self.version})")
                self._cond.wait(0.2)
                if on_wait is not None:
                    on_wait()
            return self._version.value

    def read_into(self, destination: dict[str, torch.Tensor], timeout: float = 300.0) -> int:
        """Copy a consistent snapshot into `destination` (name -> tensor, any device); return its version."""
        missing = set(self.buffers) - set(destination)
        if missing:
            raise KeyError(f"read_into() has no destination for {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            before = self._sequence.value
            if before % 2:
                time.sleep(0.001)
                continue
            version = self._version.value
            with torch.no_grad():
                for name, buffer in self.buffers.items():
                    destination[name].copy_(buffer)
            if self._sequence.value == before:
                return version
        raise RuntimeError("could not read a consistent weight snapshot (the writer never paused)")


def named_trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def named_frozen_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
