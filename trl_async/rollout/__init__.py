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
from .generator import GenerationProcess, GeneratorError, GeneratorSpec, RolloutProducer, batch_seed
from .payload import RolloutPayload
from .pipeline import RolloutBatch, RolloutPipeline, RolloutSettings
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
    "RolloutPipeline",
    "RolloutProducer",
    "RolloutSettings",
    "SharedWeightStore",
    "StalenessBoundedQueue",
    "batch_seed",
    "generate_with_behaviour_logprobs",
    "last_use_version",
]


def __getattr__(name):  # PEP 562: renamed names (`RolloutClient`); see `trl_async._compat`
    from .. import _compat

    return _compat.moved_attribute(__name__, name)
