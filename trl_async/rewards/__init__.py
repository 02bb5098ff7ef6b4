"""Tensor-native rewards: score token ids on the generator's device, without decoding.

See `docs/rewards.md` for the contract and the semantics of each built-in.
"""

from .base import TensorReward, is_tensor_reward, tensor_reward
from .format import FormatReward
from .length import LengthPenalty
from .math_answer import MathAnswerReward
from .pattern import TokenPatternReward
from .runner import prepare_rewards, score_completions
from .text import MathAnswerTextReward, math_answer_text_reward

__all__ = [
    "TensorReward",
    "tensor_reward",
    "is_tensor_reward",
    "TokenPatternReward",
    "MathAnswerReward",
    "FormatReward",
    "LengthPenalty",
    "math_answer_text_reward",
    "MathAnswerTextReward",
    "score_completions",
    "prepare_rewards",
]
