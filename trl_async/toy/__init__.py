"""The bundled tiny model and its arithmetic task: what users try first and what the tests train.

* `tiny_model_path()`: a ~1.0 M-parameter `Qwen2ForCausalLM` with its tokenizer (`tiny_qwen2/`), loadable offline,
  pre-trained on the arithmetic task and stopped while its held-out accuracy is still low, so that RL has headroom
  (`python -m trl_async.toy.build` rebuilds it).
* `make_arithmetic_dataset`: seeded two-operand problems in TRL's conversational format, with held-out splits.
* `greedy_accuracy`, `sampled_accuracy`: the task's evaluation.
* `tiny_tools_model_path()`: the tool-calling variant (`tiny_qwen2_tools/`, ``python -m trl_async.toy.build --tools``),
  with the `multiply` calculator tool, `make_multiplication_dataset` and `tool_accuracy` (`trl_async.toy.tools`): the
  toy task for `tools=`.
"""

from .arithmetic import SUPPORTED_OPS, arithmetic_prompt, arithmetic_solution, make_arithmetic_dataset
from .model import generate_completions, greedy_accuracy, sampled_accuracy, tiny_model_path
from .tools import make_multiplication_dataset, multiply, tiny_tools_model_path, tool_accuracy, tool_rollouts

__all__ = [
    "SUPPORTED_OPS",
    "arithmetic_prompt",
    "arithmetic_solution",
    "generate_completions",
    "greedy_accuracy",
    "make_arithmetic_dataset",
    "make_multiplication_dataset",
    "multiply",
    "sampled_accuracy",
    "tiny_model_path",
    "tiny_tools_model_path",
    "tool_accuracy",
    "tool_rollouts",
]
