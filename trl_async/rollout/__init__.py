"""Asynchronous rollout machinery: the staleness-bounded queue, weight publishing, backends, the generation process
and the trainer-side rollout component that the trainers share."""

from ..schedule import last_use_version
from .backends import (
    BackendContext,
    GenerationBackend,
    GenerationOutput,
    HFBackend,
    ModelSpec,
    generate_with_behaviour_logprobs,
)
from .client import RolloutBatch, RolloutClient, RolloutSettings
from .generator import GenerationProcess, GeneratorError, GeneratorSpec, RolloutProducer, batch_seed
from .payload import RolloutPayload
from .prompts import PromptStream
from .queue import QueueClosed, QueueItem, StalenessBoundedQueue
from .weights import SharedWeightStore

__all__ = [
    "BackendContext",
    "GenerationBackend",
    "GenerationOutput",
    "GenerationProcess",
    "GeneratorError",
    "GeneratorSpec",
    "HFBackend",
    "ModelSpec",
    "PromptStream",
    "QueueClosed",
    "QueueItem",
    "RolloutPayload",
    "RolloutBatch",
    "RolloutClient",
    "RolloutProducer",
    "RolloutSettings",
    "SharedWeightStore",
    "StalenessBoundedQueue",
    "batch_seed",
    "generate_with_behaviour_logprobs",
    "last_use_version",
]
