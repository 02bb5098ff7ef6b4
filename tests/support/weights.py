"""Reading a `SharedWeightStore` in tests."""

from __future__ import annotations

import torch

from trl_async.rollout.weights import SharedWeightStore


def read_copy(store: SharedWeightStore, timeout: float = 300.0) -> tuple[dict[str, torch.Tensor], int]:
    """A consistent snapshot as new CPU tensors (the store's own `read_into`), and its version."""
    copy = {name: torch.empty_like(buffer) for name, buffer in store.buffers.items()}
    return copy, store.read_into(copy, timeout=timeout)


def weight_gap(base: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two versions' weights, over every tensor."""
    return max((other[name].double() - base[name].double()).abs().max().item() for name in base)


def control_version(tagged: int, weights: dict[int, dict[str, torch.Tensor]]) -> tuple[int, float]:
    """The control of a μ check: among the kept versions other than `tagged`, the one whose weights differ most from
    the tagged version's (the largest absolute difference over every tensor), and that difference.

    The first other version is not enough: a step that does not move the policy (every advantage zero, or a weight
    update too small to see) leaves the next version equal to the last, and a "control" on equal weights would
    reproduce μ as well as the tagged version does (one GPU rank saw gaps [4.4e-06, 12.59] with tagged versions
    [0, 0, 1]). Raises when no other version is kept."""
    best: tuple[int, float] | None = None
    for version in sorted(weights):
        if version == tagged:
            continue
        gap = weight_gap(weights[tagged], weights[version])
        if best is None or gap > best[1]:
            best = (version, gap)
    if best is None:
        raise ValueError(f"only version {tagged} is kept: there is no other version to compare μ with")
    return best


def control_candidates(tagged: int, weights: dict[int, dict[str, torch.Tensor]]) -> list[tuple[int, float]]:
    """The versions a μ check's control tries, each with its weights' difference from the tagged version's: the one
    farthest in weights (`control_version`), then the first and the last kept versions other than `tagged`.

    Far weights do not always move a batch's log-probs: in a 100-step ZeRO-3 run the batches tagged 7 and 8 scored
    within 2e-4 under version 100, whose weights were 0.07 from theirs (a policy sharpened on those tokens), and 10+
    under version 0. The caller measures μ under each and keeps the version that moves it most."""
    first = control_version(tagged, weights)
    others = [v for v in sorted(weights) if v != tagged]
    candidates = [first]
    for version in (others[0], others[-1]):
        if version not in (v for v, _ in candidates):
            candidates.append((version, weight_gap(weights[tagged], weights[version])))
    return candidates
