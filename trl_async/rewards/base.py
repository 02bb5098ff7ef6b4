"""The tensor-native reward protocol.

A *tensor-native* reward scores the padded token ids the generator already holds, on the generator's device, and
never decodes them:

```python
class MyReward(TensorReward):
    def score(self, completion_ids, completion_mask, **columns):  # (B, L), (B, L), dataset columns
        return ...  # FloatTensor of shape (B,), on completion_ids.device
```

Everything tokenizer-dependent (EOS ids, token spellings of a gold answer) is prepared at construction time, or
per dataset value by the optional `prepare(**columns)` hook, which the generation process calls off the reward
path (`trl_async.rewards.prepare_rewards`); `score` itself only runs tensor ops. A value that was not prepared is
prepared on first sight inside `score`, which is correct but puts the tokenizer work on the reward path.

Every `TensorReward` is *also* an ordinary TRL reward function: `reward(prompts=..., completions=...,
completion_ids=[[...], ...], **columns)` right-pads the id lists, calls `score` and returns a `list[float]`, so the
same object works unchanged in `trl.GRPOTrainer`, in evaluation code, and in `AsyncGRPOTrainer` (which calls the
tensor path directly through `trl_async.rewards.score_completions`).
"""

from __future__ import annotations

import copyreg
import functools
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["TensorReward", "tensor_reward", "is_tensor_reward", "pad_completion_ids", "valid_token_mask"]

# Keyword arguments TRL's GRPOTrainer passes to every reward function that a tensor reward does not need as text.
_TEXT_KWARGS = ("prompts", "completions")


def _snake_case(name: str) -> str:
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    name = re.sub(r"(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return name.lower()


def pad_completion_ids(
    completion_ids: Sequence[Sequence[int]], device: torch.device | str | None = None, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a list of token-id lists to a `(B, L)` LongTensor and a `(B, L)` bool mask built from the lengths.

    This is input conversion for TRL's list-based reward signature (host-side Python data in, one tensor out); the
    padded positions hold `pad_id` and are `False` in the mask.
    """
    lengths = torch.tensor([len(row) for row in completion_ids], dtype=torch.long)
    batch = len(completion_ids)
    width = int(lengths.max()) if batch else 0
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    flat = [int(t) for row in completion_ids for t in row]
    if flat:
        ids[mask] = torch.tensor(flat, dtype=torch.long)  # row-major order == concatenation order
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask


def valid_token_mask(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor | None, eos_ids: torch.Tensor | None
) -> torch.Tensor:
    """`(B, L)` bool: the position is inside `completion_mask` and strictly before the row's first EOS token.

    `eos_ids` is a 1-D LongTensor of EOS ids on the same device (or `None`: only the mask applies). Sync-free.
    """
    valid = torch.ones_like(completion_ids, dtype=torch.bool) if completion_mask is None else completion_mask.bool()
    if eos_ids is not None and eos_ids.numel() > 0:
        is_eos = torch.isin(completion_ids, eos_ids)
        valid = valid & (is_eos.cumsum(dim=1) == 0)
    return valid


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without a host sync (pinned memory + `non_blocking` on CUDA)."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class TensorReward:
    """Base class of tensor-native rewards.

    Subclasses implement [`score`]. Instances

    - carry a `__name__` (TRL names reward functions by it): the class name in snake_case, or `name=`;
    - are callable with a tensor: `reward(completion_ids=LongTensor[B, L], completion_mask=Tensor[B, L], **columns)`
      returns `FloatTensor[B]` on the same device (positional `reward(ids, mask, **columns)` works too);
    - are callable with TRL's reward signature: `reward(prompts=..., completions=..., completion_ids=list[list[int]],
      **columns)` returns `list[float]` (the lists are right-padded on the CPU and scored with `score`).

    Extra keyword arguments TRL passes (`trainer_state`, `log_extra`, `log_metric`, `environments`, other dataset
    columns) reach `score` as `**columns`; implementations must accept and ignore the ones they do not use. The text
    arguments `prompts` and `completions` are dropped: a tensor reward never reads text.
    """

    __tensor_reward__ = True
    # Per-device copies of the reward's tables, rebuilt where the reward is used: a reward sent to the generation
    # process by value (pickled) travels without them.
    _device_caches: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._device_caches:
            state[name] = {}
        return state

    def __init__(self, *, name: str | None = None):
        if name is not None:
            self.__name__ = name

    # An instance-level `__name__` (the class keeps its own `__name__`: `type.__name__` is a data descriptor).
    @property
    def __name__(self) -> str:
        return self.__dict__.get("_reward_name") or _snake_case(type(self).__name__)

    @__name__.setter
    def __name__(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError(f"A reward name must be a non-empty string, got {value!r}.")
        self.__dict__["_reward_name"] = value

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        """Return a `FloatTensor[B]` on `completion_ids.device`. Must not decode or call a tokenizer."""
        raise NotImplementedError

    @property
    def required_columns(self) -> tuple[str, ...]:
        """Dataset columns `score` reads through `**columns` (the trainer checks that the dataset has them before it
        starts). Parameters that `score` names itself are found from its signature; the default is none."""
        return ()

    def prepare(self, **columns: Any) -> None:
        """Do, now, every tokenizer-dependent piece of work that `score` would need for rows with these values.

        `columns` are dataset columns, one list each (the same columns `score` gets, for any number of rows: a
        batch, or a whole dataset). After `prepare(**columns)`, `score` on rows whose values appeared in `columns`
        calls no tokenizer. Columns a reward does not use are ignored. Idempotent; the default does nothing (a
        reward that needs no per-value preparation). It may run in another thread than `score`: an
        implementation that mutates shared caches must guard them."""
        return None

    def __call__(self, *args: Any, completion_ids: Any = None, completion_mask: Any = None, **kwargs: Any):
        if args:
            if completion_ids is not None or len(args) > 2:
                raise TypeError(f"{self.__name__}: pass completion_ids/completion_mask either positionally or by name")
            completion_ids = args[0]
            if len(args) == 2:
                if completion_mask is not None:
                    raise TypeError(f"{self.__name__}: completion_mask given twice")
                completion_mask = args[1]
        if completion_ids is None:
            raise TypeError(f"{self.__name__} needs `completion_ids` (a LongTensor or TRL's list of token-id lists)")
        columns = {k: v for k, v in kwargs.items() if k not in _TEXT_KWARGS}
        if isinstance(completion_ids, torch.Tensor):
            if completion_mask is None:
                completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
            return self.score(completion_ids, completion_mask, **columns)
        # TRL's ordinary reward-function path: list of unpadded id lists -> list of floats.
        ids, mask = pad_completion_ids(completion_ids)
        return self.score(ids, mask, **columns).float().tolist()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.__name__!r})"


class _FunctionTensorReward(TensorReward):
    """A plain function `fn(completion_ids, completion_mask, **columns) -> FloatTensor[B]` as a `TensorReward`."""

    def __init__(self, fn: Callable[..., torch.Tensor], name: str | None = None):
        super().__init__(name=name or getattr(fn, "__name__", None) or "tensor_reward")
        self.fn = fn
        for attr in ("__module__", "__qualname__", "__doc__"):
            if hasattr(fn, attr):
                self.__dict__[attr] = getattr(fn, attr)
        self.__dict__["__wrapped__"] = fn

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        return self.fn(completion_ids, completion_mask, **columns)

    def __reduce__(self):
        # A decorated module-level function: its module attribute *is* this wrapper, so pickle it by reference
        # (pickling `fn` by reference would fail: the name no longer points at the function). Not in `__main__`: the
        # process that unpickles it (the generation process) has another `__main__`, so the wrapper travels by value
        # there, `fn` included (cloudpickle sends `__main__` functions by value). The state is set after the object
        # is created, so a function that refers to its own (decorated) name pickles without recursing.
        module = sys.modules.get(getattr(self.fn, "__module__", None) or "")
        qualname = getattr(self.fn, "__qualname__", "")
        if (
            module is not None
            and "." not in qualname
            and getattr(module, qualname, None) is self
            and _importable_by_name(module.__name__)
        ):
            return qualname
        return (copyreg.__newobj__, (type(self),), dict(self.__dict__))


def _importable_by_name(module_name: str) -> bool:
    """Whether another process finds this module by importing its name: not `__main__` (the user's script, which the
    generation process does not run), nor a module the user registered with `cloudpickle.register_pickle_by_value`."""
    if module_name in ("__main__", "__mp_main__"):
        return False
    try:
        import cloudpickle
    except ImportError:
        return True
    by_value = cloudpickle.list_registry_pickle_by_value()
    parts = module_name.split(".")
    return not any(".".join(parts[: i + 1]) in by_value for i in range(len(parts)))


def tensor_reward(fn: Callable[..., torch.Tensor] | None = None, *, name: str | None = None):
    """Mark a plain function as a tensor-native reward.

    ```python
    @tensor_reward
    def short_is_good(completion_ids, completion_mask, **columns):
        return 1.0 - completion_mask.sum(1).float() / completion_mask.shape[1]
    ```

    The function is wrapped in a [`TensorReward`], so it also accepts TRL's list-based signature. Use
    `@tensor_reward(name="...")` to choose the logged name (default: the function's `__name__`).
    """
    if fn is None:
        return functools.partial(tensor_reward, name=name)
    if not callable(fn):
        raise TypeError(
            f"@tensor_reward decorates a function `fn(completion_ids, completion_mask, **columns)`, got {fn!r} "
            f"({type(fn).__name__}). Use it as `@tensor_reward` or `@tensor_reward(name=...)` above a def."
        )
    if isinstance(fn, TensorReward):
        if name is not None:
            fn.__name__ = name
        return fn
    return _FunctionTensorReward(fn, name=name)


def check_tokenizer_argument(tokenizer: Any, owner: str, optional: bool = False) -> None:
    """Built-in rewards take a tokenizer object; a model id, a path or another object is refused with what to pass."""
    if tokenizer is None and optional:
        return
    if isinstance(tokenizer, (str, bytes)) or not (callable(tokenizer) and hasattr(tokenizer, "get_vocab")):
        shown = repr(tokenizer) if len(repr(tokenizer)) <= 60 else repr(tokenizer)[:57] + "..."
        raise TypeError(
            f"{owner}(tokenizer=...) needs a tokenizer object, got {shown} ({type(tokenizer).__name__}). Pass "
            "`AutoTokenizer.from_pretrained(model_id)` (the tokenizer of the model being trained)."
        )


def unwrap_partial(fn: Any) -> Any:
    """The callable inside any number of `functools.partial` layers (what TRL's `get_callable_name` names)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def is_tensor_reward(fn: Any) -> bool:
    """True for [`TensorReward`] instances and callables carrying `__tensor_reward__ = True`."""
    fn = unwrap_partial(fn)
    return isinstance(fn, TensorReward) or getattr(fn, "__tensor_reward__", False) is True


def as_int_tuple(seq: Iterable[Any], what: str) -> tuple[int, ...]:
    """Validate a token-id sequence: a non-empty sequence of non-negative ints."""
    if isinstance(seq, torch.Tensor):
        seq = seq.tolist()
    if isinstance(seq, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of token ids, got a string {seq!r}")
    items = list(seq)
    for t in items:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"{what} must hold integer token ids, got {t!r} ({type(t).__name__}); token ids come from "
                "`tokenizer.encode(text, add_special_tokens=False)`."
            )
    out = tuple(int(t) for t in items)
    if not out:
        raise ValueError(f"{what} is empty: an empty token pattern matches everywhere and is almost always a bug")
    if min(out) < 0:
        raise ValueError(f"{what} contains a negative token id: {out}")
    return out
