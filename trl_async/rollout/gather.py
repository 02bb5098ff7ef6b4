"""Full parameters of a sharded policy, gathered on every rank before they are published to the generation process.

Under FSDP2 and DeepSpeed ZeRO-3 a rank holds a shard of every parameter, but the generation process rebuilds the
whole model from its config and needs whole tensors, under the names that model uses. This module turns the policy's
parameters into exactly that, with torch's and DeepSpeed's own machinery:

* **FSDP2** (`fully_shard`, what accelerate's `fsdp_version: 2` applies): a sharded parameter is a `DTensor`;
  `DTensor.full_tensor()` all-gathers it (any placement, HSDP meshes included). A shard that FSDP2 offloaded to the
  host (`CPUOffloadPolicy`) is first moved to its mesh's device, as the collective runs there.
* **DeepSpeed ZeRO-3**: a partitioned parameter is an empty tensor with `ds_id`/`ds_shape`;
  `deepspeed.zero.GatheredParameters(params, modifier_rank=None)` all-gathers a group of them in place until the
  context exits. Parameters are gathered in buckets of about `bucket_bytes`, so device memory grows by one bucket,
  never by the whole model.
* **FSDP1** (`FullyShardedDataParallel`, accelerate's `fsdp_version: 1`, deprecated by transformers) is refused with a
  message that says to switch to FSDP2.
* Anything else (one process, DDP, ZeRO-1/2) holds whole parameters: they are returned as they are, without a copy.

Gathering is a collective: every rank must walk the same parameters in the same order at the same moment (the trainer
publishes on every rank at the same optimizer steps). Each rank then writes its own generation process's store (see
`RolloutPipeline.publish`): after an all-gather every rank already holds the whole tensor, so this costs no further
communication, and the one-generator-per-rank design stays as it is.

Names: wrappers that torch and accelerate put around modules add a path component to parameter names
(`_fsdp_wrapped_module.` for FSDP1, `_checkpoint_wrapped_module.` for activation checkpointing, `_orig_mod.` for
`torch.compile`); `clean_parameter_name` removes them, so names match the generator's model (built from the base
config, plus the PEFT config). FSDP2 and ZeRO-3 do not rename parameters, and DDP's `module.` prefix is gone once
accelerate unwraps the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

# Path components that module wrappers insert into parameter names (torch's FSDP1 and checkpoint wrappers, and
# `torch.compile`'s `OptimizedModule`); the generator's plain transformers model has none of them.
WRAPPER_NAME_COMPONENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

# ZeRO-3 parameters are gathered in groups of about this many bytes (the device-memory overhead of a publish).
DEFAULT_BUCKET_BYTES = 256 * 2**20

FSDP2 = "FSDP2"
ZERO3 = "DeepSpeed ZeRO-3"

FSDP1_MESSAGE = (
    "FSDP1 (torch's FullyShardedDataParallel; accelerate's fsdp_version 1) is not supported with asynchronous "
    "generation: its flat parameters cannot be published to the generation process. Use FSDP2: `fsdp_version: 2` in "
    "the accelerate config (`accelerate launch --use_fsdp --fsdp_version 2`), or `fsdp_config={'version': 2}` in the "
    "training arguments (transformers' default)"
)


def clean_parameter_name(name: str) -> str:
    """`name` without the path components that module wrappers add (see `WRAPPER_NAME_COMPONENTS`)."""
    for component in WRAPPER_NAME_COMPONENTS:
        name = name.replace(component, "")
    return name


def is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_zero3_parameter(tensor: torch.Tensor) -> bool:
    """A parameter partitioned by DeepSpeed ZeRO-3 (the attribute DeepSpeed's own `is_zero_param` checks)."""
    return hasattr(tensor, "ds_id")


def uses_fsdp1(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def model_sharding(model: torch.nn.Module) -> str | None:
    """`FSDP2`, `ZERO3` or None (whole parameters on every rank). Raises `ValueError` for FSDP1.

    Read from the parameters themselves, so it holds however the sharding was applied (accelerate, the HF Trainer's
    `fsdp_config`, a user's own `fully_shard`)."""
    if uses_fsdp1(model):
        raise ValueError(FSDP1_MESSAGE + ".")
    for parameter in model.parameters():
        if is_dtensor(parameter):
            return FSDP2
        if is_zero3_parameter(parameter):
            return ZERO3
    return None


def full_shape(parameter: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter (a `DTensor`'s shape is already its global shape)."""
    if is_zero3_parameter(parameter):
        return torch.Size(parameter.ds_shape)
    return parameter.shape


def full_placeholders(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor with the whole parameter's shape and dtype): what a `SharedWeightStore` is sized from,
    without gathering anything."""
    return [(name, torch.empty(full_shape(p), dtype=p.dtype, device="meta")) for name, p in named]


def _collective_device(tensor) -> torch.device:
    """The device on which a DTensor's collectives run: its mesh's device type, this rank's current device of it."""
    device_type = tensor.device_mesh.device_type
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    bucket, size = [], 0
    for name, parameter in named:
        bucket.append((name, parameter))
        size += full_shape(parameter).numel() * parameter.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


@contextlib.contextmanager
def _zero3_gathered(parameters: list[torch.Tensor]):
    if not parameters:
        yield
        return
    import deepspeed

    # modifier_rank=None: read-only, every rank receives the whole tensors (and frees them on exit).
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        yield


@torch.no_grad()
def iter_full_parameters(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each of `named`, in order.

    A sharded parameter comes back as a host (CPU) tensor that no later gather overwrites, gathered one parameter
    (FSDP2) or one bucket (ZeRO-3) at a time, so device memory never holds more than that; a whole parameter comes back
    as itself (no copy).

    Collective: every rank must exhaust this iterator over the same names in the same order.
    """
    for bucket in _buckets(named, bucket_bytes):
        with _zero3_gathered([p for _, p in bucket if is_zero3_parameter(p)]):
            for name, parameter in bucket:
                if is_dtensor(parameter):
                    device = _collective_device(parameter)
                    if parameter.device != device:  # a shard offloaded to the host by FSDP2's CPUOffloadPolicy
                        parameter = parameter.to(device)
                    yield name, parameter.full_tensor().to("cpu")
                elif is_zero3_parameter(parameter):
                    # The gathered storage is freed when the context exits: keep a copy.
                    yield name, parameter.detach().to("cpu", copy=True)
                else:
                    yield name, parameter


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FSDP1_MESSAGE",
    "FSDP2",
    "WRAPPER_NAME_COMPONENTS",
    "ZERO3",
    "clean_parameter_name",
    "full_placeholders",
    "full_shape",
    "is_dtensor",
    "is_zero3_parameter",
    "iter_full_parameters",
    "model_sharding",
    "uses_fsdp1",
]
