"""Asynchronous rollout machinery: the staleness-bounded queue, weight publishing, backends and the generator."""

from .backends import GenerationBackend, GenerationOutput, HFBackend, ModelSpec
from .generator import GenerationProcess, GeneratorError, GeneratorSpec
from .queue import QueueClosed, QueueItem, StalenessBoundedQueue, last_use_version
from .weights import SharedWeightStore

__all__ = [
    "GenerationBackend",
    "GenerationOutput",
    "GenerationProcess",
    "GeneratorError",
    "GeneratorSpec",
    "HFBackend",
    "ModelSpec",
    "QueueClosed",
    "QueueItem",
    "SharedWeightStore",
    "StalenessBoundedQueue",
    "last_use_version",
]
