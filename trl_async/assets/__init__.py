"""Moved to `trl_async.toy` (the bundled tiny model and its arithmetic task); kept for old imports."""

import warnings

from ..toy.model import generate_completions, greedy_accuracy, sampled_accuracy, tiny_model_path

warnings.warn(
    "trl_async.assets moved to trl_async.toy; import tiny_model_path from trl_async.toy.", FutureWarning, stacklevel=2
)

__all__ = ["generate_completions", "greedy_accuracy", "sampled_accuracy", "tiny_model_path"]
