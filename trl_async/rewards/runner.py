"""`score_completions`: run a mix of tensor-native and text reward functions over one batch.

The generation process calls this with the padded ids it sampled. Tensor-native rewards get the tensors directly;
text rewards get TRL's usual arguments. Decoding happens at most once per batch, and only when a text reward is
present: with only tensor-native rewards nothing is decoded.

Output contract, checked per function (the error names the function):

- tensor rewards must return a floating-point tensor of shape `(B,)` on `completion_ids.device`. A wrong shape or a
  wrong device is a `ValueError`; a bool/integer tensor (or a list) is a `TypeError`: the contract asks for float
  scores, and an integer tensor is usually a bug (ids, indices or counts returned by mistake). Any floating dtype
  is accepted and cast to float32.
- text rewards must return a sequence of length `B` (`ValueError` otherwise) whose items are real numbers
  (`int`, `float`, `bool`, numpy/torch scalars: converted to float, as TRL does) or `None` (converted to NaN, as
  TRL does); anything else (a string, a list, a complex number) is a `TypeError`.
- NaN passes through unchanged. Like TRL, a NaN/None reward means "this function does not apply to this row":
  TRL's advantage code sums rewards with `nansum`, and a row where every function is NaN is unscorable and gets
  zero advantage. Nothing here turns NaN into 0.
- +inf and -inf are a `ValueError` (they would make every advantage of the group NaN or infinite, and TRL would log
  them while the loss is 0).
- A reward function that raises: its exception propagates as in TRL (same type, same message), with a note that
  names the function and says what to do (a row it cannot score should get `None`, as in TRL).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .base import TensorReward, is_tensor_reward, unwrap_partial

__all__ = ["score_completions", "prepare_rewards", "reward_name"]

_NOT_SCORED = "return None (or NaN) for the rows it cannot score, as in TRL"


def reward_name(fn: Any) -> str:
    """TRL's display name for a reward callable (`trl.trainer.utils.get_callable_name`)."""
    fn = unwrap_partial(fn)
    return getattr(fn, "__name__", type(fn).__name__)


def prepare_rewards(reward_funcs: Sequence[Callable[..., Any]], columns: dict[str, Sequence[Any]]) -> None:
    """Warm every tokenizer-dependent cache of the tensor-native rewards for rows with these column values, so that
    scoring those rows later calls no tokenizer.

    Calls `prepare(**columns)` on every tensor-native reward that has one ([`TensorReward.prepare`]; through a
    `functools.partial`, on the wrapped reward); text rewards and reward models are skipped. `columns` are dataset
    columns, one sequence each, as `score_completions` gets them (`{"answer": [...], ...}`), for a batch or a whole
    dataset; they need not have the batch's length. Values already prepared cost a dict lookup each.

    The generation process calls it off the reward path: on the dataset's columns at start-up, and on the next
    batch's rows while the current batch generates. Rewards that are not prepared still work: they prepare new
    values on first sight, inside `score`.
    """
    if not isinstance(columns, dict):
        raise TypeError(f"prepare_rewards takes the dataset columns as a dict of lists, got {type(columns).__name__}")
    for fn in reward_funcs:
        if not is_tensor_reward(fn):
            continue
        target = unwrap_partial(fn)
        prepare = getattr(target, "prepare", None)
        if callable(prepare):
            prepare(**columns)


def _unpad(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[list[int]]:
    ids, mask = completion_ids.tolist(), completion_mask.bool().tolist()
    return [[t for t, m in zip(row, mrow, strict=True) if m] for row, mrow in zip(ids, mask, strict=True)]


def _check_tensor_output(out: Any, batch: int, device: torch.device, name: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"Tensor-native reward function '{name}' returned {type(out).__name__}; it must return a floating-point "
            f"torch.Tensor of shape ({batch},)."
        )
    if out.shape != (batch,):
        raise ValueError(
            f"Tensor-native reward function '{name}' returned a tensor of shape {tuple(out.shape)}, but ({batch},) was "
            "expected (one reward per completion)."
        )
    if not out.is_floating_point():
        raise TypeError(
            f"Tensor-native reward function '{name}' returned a {out.dtype} tensor; rewards must be a floating-point "
            "tensor (convert explicitly, e.g. `matches.float()`)."
        )
    if out.device != device:
        raise ValueError(
            f"Tensor-native reward function '{name}' returned a tensor on {out.device}, but the completions are on "
            f"{device}; keep the rewards on the completions' device."
        )
    return out.to(torch.float32)


def _infinite_reward(name: str, value: float, row: int) -> ValueError:
    return ValueError(
        f"The reward function '{name}' returned {value} for completion {row}; rewards must be finite (an infinite "
        f"reward makes its group's advantages NaN). Clip it to a finite value, or {_NOT_SCORED}."
    )


def _to_float(value: Any, name: str, row: int) -> float:
    if value is None:
        return float("nan")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, (numbers.Real, np.bool_)):  # int, float, bool, numpy scalars
        return float(value)
    raise TypeError(
        f"The reward function '{name}' returned {value!r} ({type(value).__name__}) for completion {row}; rewards "
        "must be real numbers or None."
    )


def _run_maybe_async(result: Any) -> Any:
    if inspect.isawaitable(result):

        async def _wait():
            return await result

        return asyncio.run(_wait())
    return result


def score_completions(
    reward_funcs: Sequence[Callable[..., Any]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    columns: dict[str, list],
    *,
    prompts: list,
    decode: Callable[[], list],
    reward_func_names: Sequence[str] | None = None,
    extra_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Score one batch with every reward function; returns `FloatTensor[B, len(reward_funcs)]` on the ids' device.

    Args:
        reward_funcs: tensor-native rewards ([`TensorReward`] or `__tensor_reward__` callables) and/or ordinary TRL
            reward functions (`prompts=, completions=, completion_ids=, **columns -> list[float | None]`; an async
            one is awaited).
        completion_ids: `(B, L)` padded completion ids; `completion_mask`: `(B, L)`, 1 on completion tokens (TRL's
            mask: up to and including the first EOS).
        columns: dataset columns, one list of length B each (without `prompt`/`completion`/`completion_ids`).
        prompts: the prompts, passed to text rewards.
        decode: returns the decoded completions (strings or conversational messages). Called at most once, and
            only if a text reward is present.
        reward_func_names: names used in error messages (default: TRL's `get_callable_name`).
        extra_kwargs: extra keyword arguments for every reward function (TRL passes `trainer_state`, `log_extra`,
            `log_metric`).

    See the module docstring for the output checks and the NaN semantics.
    """
    batch = completion_ids.shape[0]
    device = completion_ids.device
    names = list(reward_func_names) if reward_func_names is not None else [reward_name(f) for f in reward_funcs]
    if len(names) != len(reward_funcs):
        raise ValueError(f"{len(names)} reward_func_names for {len(reward_funcs)} reward functions")
    for key, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) != batch:
            raise ValueError(f"dataset column {key!r} has {len(values)} values for {batch} completions")
    extra = dict(extra_kwargs or {})
    rewards = torch.empty(batch, len(reward_funcs), dtype=torch.float32, device=device)
    completions: list | None = None
    ids_list: list[list[int]] | None = None

    for i, (fn, name) in enumerate(zip(reward_funcs, names, strict=True)):
        if isinstance(fn, torch.nn.Module) and not is_tensor_reward(fn):
            raise TypeError(
                f"Reward '{name}' is a model; score_completions runs reward callables only (the trainer scores "
                "reward models)."
            )
        if is_tensor_reward(fn):
            with _reported_as(name):
                if isinstance(fn, TensorReward):
                    out = fn.score(completion_ids, completion_mask, **columns, **extra)
                else:
                    out = fn(completion_ids=completion_ids, completion_mask=completion_mask, **columns, **extra)
            rewards[:, i] = _check_tensor_output(out, batch, device, name)
            continue
        if completions is None:
            completions = decode()
            if len(completions) != batch:
                raise ValueError(f"decode() returned {len(completions)} completions for {batch} rows")
            ids_list = _unpad(completion_ids, completion_mask)
        with _reported_as(name):
            out = _run_maybe_async(
                fn(prompts=prompts, completions=completions, completion_ids=ids_list, **columns, **extra)
            )
        if isinstance(out, torch.Tensor):
            out = _check_tensor_output(out, batch, out.device, name).tolist()
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
            raise TypeError(f"The reward function '{name}' returned {type(out).__name__}; expected a list of floats.")
        if len(out) != batch:
            raise ValueError(
                f"The reward function '{name}' returned {len(out)} rewards, but {batch} were expected (one per "
                "prompt-completion pair)."
            )
        values = [_to_float(v, name, row) for row, v in enumerate(out)]
        rewards[:, i] = torch.tensor(values, dtype=torch.float32).to(device)
    infinite = torch.isinf(rewards)
    if infinite.any():  # one host sync per batch (the payload is copied to the host right after anyway)
        row, column = (int(k) for k in infinite.nonzero()[0])
        raise _infinite_reward(names[column], float(rewards[row, column]), row)
    return rewards


@contextlib.contextmanager
def _reported_as(name: str):
    """A reward function's own exception propagates unchanged (its type and message, as in TRL), with a note naming
    the function and saying what to do: Python prints it under the message, and the generation process puts it on
    the first line of what it reports (`rollout.generator.error_report`)."""
    try:
        yield
    except Exception as error:
        note = f"Raised by the reward function '{name}': fix it, or {_NOT_SCORED}."
        with contextlib.suppress(AttributeError, TypeError):
            if hasattr(error, "add_note"):
                error.add_note(note)
            else:  # Python 3.10
                error.__notes__ = [*getattr(error, "__notes__", []), note]
        raise
