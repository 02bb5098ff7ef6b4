"""Generation backends of the rollout process.

A backend owns the generator's copy of the policy. Its interface is deliberately small, so that a backend talking to
a `trl vllm-serve` server can slot in without touching the queue or the trainer:

* `load()` builds the model and applies the start-up weights;
* `generate(prompt_ids)` samples one completion per prompt row and returns the ids (cut after the first EOS) with the
  behaviour log-probabilities of the sampled tokens;
* `update_weights()` swaps in the latest published weights; it is only called between generation batches.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from .weights import SharedWeightStore


@dataclasses.dataclass
class GenerationOutput:
    completion_ids: torch.Tensor  # (B, L) right-padded with pad_token_id, on the backend's device
    completion_mask: torch.Tensor  # (B, L) bool, True up to and including the first EOS
    logprobs: torch.Tensor  # (B, L) float32 behaviour log-probs, 0 on padding

    def to_lists(self) -> tuple[list[list[int]], list[list[float]]]:
        lengths = self.completion_mask.sum(dim=1).tolist()
        ids, logps = self.completion_ids.tolist(), self.logprobs.tolist()
        return [row[:n] for row, n in zip(ids, lengths, strict=True)], [
            row[:n] for row, n in zip(logps, lengths, strict=True)
        ]


@dataclasses.dataclass
class ModelSpec:
    """What the generator needs to build its own copy of the policy (the weights come through shared memory)."""

    config: object  # transformers PretrainedConfig of the base model
    dtype: torch.dtype
    peft_config: object | None = None  # peft.PeftConfig when the trainer trains an adapter
    adapter_name: str = "default"


class GenerationBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def load(self) -> int:
        """Build the model and load the start-up weights; return their version."""

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput: ...

    @abc.abstractmethod
    def update_weights(self) -> int:
        """Swap in the latest published weights (between batches); return their version."""


def first_eos_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """True for every position up to and including the first EOS of each row (all True if there is none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    # Number of EOS strictly before each position: a position is valid while that count is zero.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return eos_before == 0


class _Heartbeat(LogitsProcessor):
    """Calls `beat()` at every decoding step, so a long generation still shows progress."""

    def __init__(self, beat: Callable[[], None]):
        self.beat = beat

    def __call__(self, input_ids, scores):
        self.beat()
        return scores


class HFBackend(GenerationBackend):
    """transformers `generate`, on any device, CPU included."""

    name = "hf"

    def __init__(
        self,
        model_spec: ModelSpec,
        frozen_store: SharedWeightStore | None,
        trainable_store: SharedWeightStore,
        generation_config: GenerationConfig,
        temperature: float,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: str | torch.device = "cpu",
        heartbeat: Callable[[], None] = lambda: None,
    ):
        self.model_spec = model_spec
        self.frozen_store = frozen_store
        self.trainable_store = trainable_store
        # Our own copy, asking `generate` for the raw logits of every step (the behaviour log-probs need them).
        self.generation_config = copy.deepcopy(generation_config)
        self.generation_config.output_logits = True
        self.generation_config.return_dict_in_generate = True
        # Trainers switch `use_cache` off for training; generating without a KV cache is quadratic (10x slower here).
        self.generation_config.use_cache = True
        self.temperature = temperature
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.heartbeat = heartbeat
        self.model = None
        self.version = -1

    def load(self) -> int:
        spec = self.model_spec
        config = copy.deepcopy(spec.config)
        config.use_cache = True
        model = AutoModelForCausalLM.from_config(config, dtype=spec.dtype)
        if spec.peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, spec.peft_config, adapter_name=spec.adapter_name)
        model.to(self.device).eval()
        self.model = model
        self._params = dict(model.named_parameters())
        stores = [s for s in (self.frozen_store, self.trainable_store) if s is not None]
        unknown = [name for store in stores for name in store.names if name not in self._params]
        if unknown:
            raise RuntimeError(
                f"The generator's model has no parameters named like the trainer's, e.g. {unknown[:3]}. The "
                "generator rebuilds the model from its config (and PEFT config); models whose parameter names "
                "differ after that are not supported."
            )
        if self.frozen_store is not None:
            self.frozen_store.read_into(self._params)
        return self.update_weights()

    def update_weights(self) -> int:
        if self.trainable_store.version != self.version:
            self.version = self.trainable_store.read_into(self._params)
        return self.version

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding, as TRL does for generation
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([_Heartbeat(self.heartbeat)]),
        )
        completion_ids = out.sequences[:, width:]
        # Behaviour log-probs under the trainer's own scaling: log_softmax(raw logits / temperature), as TRL's
        # `_get_per_token_logps_and_entropies` computes them. `output_logits` are the raw logits (before processors).
        logits = torch.stack(out.logits, dim=1).float() / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        mask = first_eos_mask(completion_ids, self.eos_token_ids)
        completion_ids = completion_ids.masked_fill(~mask, self.pad_token_id)
        return GenerationOutput(completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs * mask)


def make_backend(name: str, **kwargs) -> GenerationBackend:
    if name == "hf":
        return HFBackend(**kwargs)
    raise ValueError(f"Unknown generation backend {name!r}.")
