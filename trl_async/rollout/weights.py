"""Publishing policy weights from the trainer to the generation process through shared memory.

The trainer owns a set of CPU tensors in shared memory, one per published parameter, all views of one flat shared
buffer per dtype. Publishing copies the current parameters into them; the generator copies them into its own model
between generation batches, never mid-sequence. (One buffer per dtype, not one per tensor: a store travels to the
generation process through a fork server, which passes every shared buffer as a file descriptor and refuses more than
256 of them; Qwen2.5-0.5B's frozen base alone has 290 tensors.)

Torn reads are prevented with a sequence lock: the writer makes the sequence odd, copies, records the version, then
makes the sequence even again. A reader copies only between two equal even sequence values and retries otherwise, so it
never applies a half-written mix of two versions.

No lock, condition or semaphore is shared between the processes: the sequence and the version are plain shared
integers written by the trainer alone. A generator that dies at any moment (SIGKILL included) can therefore never
leave something held that the trainer would wait for; the trainer never waits for the reader at all.

Which tensors travel: the *trainable* parameters. For a full fine-tune that is every parameter; for a PEFT model it is
only the adapter tensors, so a LoRA sync moves a few MB whatever the size of the frozen base. The frozen parameters
travel once, at start-up, in a separate store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch
import torch.multiprocessing as torch_mp


class SharedWeightStore:
    """Named CPU tensors in shared memory, versioned, written by one process (the trainer) and read by another."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], mp_context="spawn"):
        ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        # name -> (dtype, offset, shape) in the flat buffer of its dtype
        self._layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = {}
        sizes: dict[torch.dtype, int] = {}
        for name, tensor in named_tensors:
            offset = sizes.get(tensor.dtype, 0)
            self._layout[name] = (tensor.dtype, offset, tuple(tensor.shape))
            sizes[tensor.dtype] = offset + tensor.numel()
        self._flat = {dtype: _shared_buffer(max(n, 1), dtype) for dtype, n in sizes.items()}
        self.buffers: dict[str, torch.Tensor] = self._views()
        # Written by the publisher only; a 64-bit aligned word is read and written atomically on the platforms torch
        # supports, and stores are not reordered past the copy (the copy is a function call that returns after it).
        self._sequence = ctx.RawValue("q", 0)
        self._version = ctx.RawValue("q", -1)

    def _views(self) -> dict[str, torch.Tensor]:
        return {
            name: self._flat[dtype][offset : offset + math.prod(shape)].view(shape)
            for name, (dtype, offset, shape) in self._layout.items()
        }

    def __getstate__(self) -> dict:
        # The flat buffers travel (one file descriptor per dtype), the views are rebuilt on arrival.
        state = self.__dict__.copy()
        del state["buffers"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.buffers = self._views()

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
        """Copy `named_tensors` (any device, any iterable: a gathering generator is consumed one tensor at a time, so
        a sharded model never has every whole tensor alive at once) into shared memory and mark them as `version`.
        Never blocks. If a tensor is missing or does not fit, the error leaves the sequence odd: readers keep the
        previous snapshot's copy they hold, and the next successful publish makes it consistent again."""
        # Odd: write in progress. `|= 1`, not `+= 1`: a publish that raised mid-copy left the sequence odd, and the
        # next one must not turn it even while it writes.
        self._sequence.value |= 1
        written = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in self.buffers:
                    self.buffers[name].copy_(tensor.detach())
                    written.add(name)
        missing = set(self.buffers) - written
        if missing:
            raise KeyError(f"publish() is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self._version.value = version
        self._sequence.value += 1  # even: consistent

    def wait_for_version(
        self,
        min_version: int,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.002,
    ) -> int:
        """Poll until weights of at least `min_version` are published; return the published version.

        `on_wait` is called about every 0.2 s while waiting (heartbeat, stop request); it may raise to abort.
        """
        start = time.perf_counter()
        last_callback = start
        while self._version.value < min_version:
            now = time.perf_counter()
            if timeout is not None and now - start >= timeout:
                raise TimeoutError(f"weights v{min_version} were not published in time (have v{self.version})")
            if on_wait is not None and now - last_callback >= 0.2:
                on_wait()
                last_callback = now
            time.sleep(poll_s)
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


def _shared_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor allocated in shared memory directly (torch.multiprocessing's own allocator,
    `_new_shared`). `torch.empty(...).share_memory_()` would copy a private buffer into it, touching every page of
    both, on the caller's thread: 3.6 to 10 s for a 0.5B model's 2 GB base on the development VM. Here the pages are
    touched by the first publish, which for the frozen weights runs beside the trainer's first steps
    (`RolloutPipeline._publish_frozen`)."""
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def named_trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def named_frozen_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
