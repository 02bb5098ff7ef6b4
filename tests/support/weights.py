"""Reading a `SharedWeightStore` in tests."""

from __future__ import annotations

import torch

from trl_async.rollout.weights import SharedWeightStore


def read_copy(store: SharedWeightStore, timeout: float = 300.0) -> tuple[dict[str, torch.Tensor], int]:
    """A consistent snapshot as new CPU tensors (the store's own `read_into`), and its version."""
    copy = {name: torch.empty_like(buffer) for name, buffer in store.buffers.items()}
    return copy, store.read_into(copy, timeout=timeout)
