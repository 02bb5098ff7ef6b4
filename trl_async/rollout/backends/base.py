"""The generation backend interface, and what a backend returns.

A backend owns the generator's copy of the policy. Every backend is built as `Backend(context, **options)`: a
`BackendContext` (the policy to build, the weight stores, the sampling settings, the device, the heartbeat), then the
options of that engine alone. Its interface is deliberately small, so that engines (transformers `generate` in `hf`, a
vLLM engine in `vllm`, a `trl vllm-serve` server in `vllm_server`) slot in without touching the queue or the trainers:

* `load()` builds the model and applies the start-up weights; returns their version;
* `generate(prompt_ids, seed)` samples one completion per prompt row and returns the ids (cut after the first EOS) with
  the behaviour log-probabilities of the sampled tokens; `generate_batches(batches)` does it for several generation
  batches in one decode where the engine can (each batch sampled from its own seed, so its rows do not depend on the
  batches decoded beside it), one after another otherwise;
* `update_weights()` swaps in the latest published weights; it is only called between generation batches;
* `warm_up(sample_prompt_ids)` (optional) runs once before the generation process reports ready;
* `close()` releases the engine.

**Behaviour log-probs μ** (DESIGN.md section 2) are the log-probabilities of the sampled tokens under the distribution
that actually sampled them: the logits after every processor and warper of the generation config (repetition penalty,
temperature, top-k, top-p, min-p, ...), recorded step by step in O(B·L) memory, never as stacked vocabulary-sized
scores.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from ..weights import SharedWeightStore


@dataclasses.dataclass
class GenerationOutput:
    completion_ids: torch.Tensor  # (B, L) right-padded with pad_token_id, on the backend's device
    completion_mask: torch.Tensor  # (B, L) bool, True up to and including the first EOS
    logprobs: torch.Tensor  # (B, L) float32 behaviour log-probs, 0 on padding
    # (B, L) log-probs of the same tokens under the behaviour weights in the trainer's parametrization (logits /
    # temperature, no top-k/top-p/min-p/repetition penalty), or None where the backend cannot give them (vLLM).
    policy_logprobs: torch.Tensor | None = None
    # (B, L) int64: the weights version that computed each token's logits (in-flight weight updates change it
    # between decoding steps), or None where the backend does not record it (every token: the batch's version).
    token_versions: torch.Tensor | None = None

    def importance_logprobs(self) -> torch.Tensor:
        """The behaviour log-probs the trainer's importance weight and M2PO compare π_θ with.

        The trainer's π_θ is TRL's: log-softmax of logits / temperature, with no sampling warpers. Against the processed
        μ (what `generate` sampled from), π_θ/μ would measure the warpers' truncation as well as the policy lag: with
        `top_k=10` on a 150k vocabulary it is ~1e-4 per token even at staleness 0, the sequence weight underflows, and
        training stops (TRL's own `test_train_with_additional_generation_kwargs` caught it). Comparing like with like
        leaves only the lag: the weight is exactly 1 at staleness 0, as in synchronous TRL, which trains on the warped
        samples without a correction."""
        return self.policy_logprobs if self.policy_logprobs is not None else self.logprobs

    def token_version_lists(self) -> list[list[int]] | None:
        """Per row, without padding, the version of the weights that sampled each token (None if not recorded)."""
        if self.token_versions is None:
            return None
        lengths = self.completion_mask.sum(dim=1).tolist()
        return [row[:n] for row, n in zip(self.token_versions.tolist(), lengths, strict=True)]

    def split(self, sizes: Sequence[int]) -> list[GenerationOutput]:
        """The rows of consecutive generation batches of `sizes` rows, each cut to its own longest completion (what a
        decode of that batch alone returns)."""
        parts, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            width = int(self.completion_mask[rows].sum(dim=1).max()) if size else 0
            parts.append(
                GenerationOutput(
                    **{
                        f.name: None if (value := getattr(self, f.name)) is None else value[rows, :width]
                        for f in dataclasses.fields(self)
                    }
                )
            )
            start += size
        if start != self.completion_ids.size(0):
            raise ValueError(f"split sizes {list(sizes)} do not add up to the {self.completion_ids.size(0)} rows")
        return parts

    def to_lists(self) -> tuple[list[list[int]], list[list[float]]]:
        """Completion ids and importance log-probs (`importance_logprobs`) per row, without padding."""
        lengths = self.completion_mask.sum(dim=1).tolist()
        ids, logps = self.completion_ids.tolist(), self.importance_logprobs().tolist()
        return [row[:n] for row, n in zip(ids, lengths, strict=True)], [
            row[:n] for row, n in zip(logps, lengths, strict=True)
        ]


@dataclasses.dataclass(frozen=True)
class SeededPrompts:
    """One generation batch's share of a decode: its prompt rows, sampled from its own seed (None: the caller's RNG)."""

    prompt_ids: list[list[int]]
    seed: int | None = None


@dataclasses.dataclass
class ModelSpec:
    """What the generator needs to build its own copy of the policy (the weights come through shared memory)."""

    config: object  # transformers PretrainedConfig of the base model
    dtype: torch.dtype
    peft_config: object | None = None  # peft.PeftConfig when the trainer trains an adapter
    adapter_name: str = "default"
    # The trainer model's own `generation_config` (its generation_config.json): transformers fills the fields TRL's
    # GenerationConfig leaves unset from it, so the generator's copy must carry the same defaults.
    generation_defaults: object | None = None


def no_heartbeat() -> None:
    """The default heartbeat: nothing watches the backend. A module-level function rather than a lambda, so that a
    `BackendContext` pickles (tests send contexts to spawned processes)."""


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """What every backend is built from, whichever engine it drives; each backend takes its own options besides."""

    model_spec: ModelSpec
    # The weights the trainer never changes (a LoRA model's base), read once at `load()`; None for a full fine-tune
    # whose parameters are all trainable.
    frozen_store: SharedWeightStore | None
    trainable_store: SharedWeightStore  # the weights the trainer publishes, read at every `update_weights()`
    # TRL's generation config: each backend derives its own sampling settings from it (`hf`: a copy set up for
    # rollouts; `vllm`: SamplingParams fields, refused where vLLM cannot honour them).
    generation_config: GenerationConfig
    temperature: float  # the trainer's, which its π_θ divides the logits by
    eos_token_ids: Sequence[int]  # a completion ends after the first of these
    pad_token_id: int  # fills completions after their end
    device: str | torch.device = "cpu"
    # Called at every decoding step and weight update: the trainer takes a generation process that stops beating for
    # a hung one.
    heartbeat: Callable[[], None] = no_heartbeat


class GenerationBackend(abc.ABC):
    name: str

    def __init__(self, context: BackendContext):
        self.context = context
        self.model_spec = context.model_spec
        self.frozen_store = context.frozen_store
        self.trainable_store = context.trainable_store
        self.eos_token_ids = list(context.eos_token_ids)
        self.pad_token_id = context.pad_token_id
        self.device = torch.device(context.device)
        self.heartbeat = context.heartbeat
        self.version = -1  # the weights version loaded; -1 until `load()`
        self.compile_fallbacks = 0  # decodes that fell back to eager decoding after a failed compilation

    @abc.abstractmethod
    def load(self) -> int:
        """Build the model and load the start-up weights; return their version."""

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], seed: int | None = None, ready=None) -> GenerationOutput:
        """Sample one completion per prompt row. `ready()`, if given, is called once the batch is laid out and before
        the model first runs on it: with in-flight weight updates the generation process waits there for recent enough
        weights (the batch's oldest token defines its staleness, and its prompts' keys and values are computed by the
        same weights)."""

    def generate_batches(self, batches: Sequence[SeededPrompts], ready=None) -> list[GenerationOutput]:
        """Sample the rows of several generation batches, each from its own seed; one output per batch. This default
        decodes them one after another (`generate`); a backend that can decode them in one call overrides it (`hf`,
        `vllm`). `ready()`, if given, runs once, before the model first runs on any of them."""
        outputs = []
        for i, batch in enumerate(batches):
            if i == 0 and ready is not None:
                outputs.append(self.generate(batch.prompt_ids, batch.seed, ready))
            else:
                outputs.append(self.generate(batch.prompt_ids, batch.seed))
        return outputs

    @abc.abstractmethod
    def update_weights(self) -> int:
        """Swap in the latest published weights (between batches, or between decoding steps with in-flight updates);
        return their version."""

    def warm_up(self, sample_prompt_ids: Callable[[], list[list[int]]]) -> None:  # noqa: B027 (optional hook)
        """Before the generation process reports ready: prepare what the first decode would otherwise pay for (CUDA
        graph capture in `hf`), from prompts of the run's shapes (`sample_prompt_ids()`, called only if needed)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the engine."""


def first_eos_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """True for every position up to and including the first EOS of each row (all True if there is none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    # Number of EOS strictly before each position: a position is valid while that count is zero.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return eos_before == 0
