"""AsyncGRPOTrainer with the vLLM backend (real vLLM CPU engine in the generation process, the bundled tiny model).

Run in the vLLM environment (`bash .ci/vllm_env.sh`). Weight sync is checked from the weights themselves: every batch's
behaviour log-probs (vLLM's processed log-probs) must be reproduced, by a transformers forward, by the weights version
the batch is tagged with.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not importable here: these tests run in the vLLM environment (`bash .ci/vllm_env.sh`).",
)

from trl import GRPOConfig  # noqa: E402

from tests.support.trainer_utils import WeightTracingTrainer, length_reward, load_model, load_tokenizer, make_args  # noqa: E402
from trl_async import AsyncGRPOTrainer  # noqa: E402
from trl_async.toy import make_arithmetic_dataset  # noqa: E402


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=256, num_test=8, seed=1)["train"]


def test_twenty_async_steps_with_the_vllm_engine_and_weight_sync(tmp_path, dataset):
    args = make_args(
        tmp_path, max_steps=20, generation_backend="vllm", max_staleness=1, loss_type="dapo",
        trainer_generates_while_starting=False, logging_steps=5,
    )  # fmt: skip
    trainer = WeightTracingTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 20
    assert len(trainer.tag_is_true) == 20 and all(trainer.tag_is_true)  # vLLM sampled with the tagged weights
    assert max(trainer.true_staleness) <= 1 and max(trainer.true_staleness) >= 1
    assert trainer.weights_by_version[0]["lm_head.weight"].ne(trainer.weights_by_version[20]["lm_head.weight"]).any()


def test_use_vllm_in_a_plain_grpo_config_runs_asynchronously(tmp_path, dataset):
    args = make_args(tmp_path, config_cls=GRPOConfig, max_steps=3, use_vllm=True, vllm_mode="colocate")
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    assert trainer.args.generation_backend == "vllm" and not trainer.use_vllm  # TRL's in-process vLLM never starts
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 3 and all("async/staleness_mean" in h for h in logged)


@pytest.mark.slow
def test_async_training_with_vllm_learns_the_tiny_job(tmp_path):
    """The recipe's tiny job (generated arithmetic, a correctness reward) with the vLLM backend: reward rises."""
    from trl_async.rewards import math_answer_text_reward

    args = make_args(
        tmp_path, max_steps=150, per_device_train_batch_size=64, num_generations=8, max_completion_length=48,
        learning_rate=1e-4, lr_scheduler_type="constant", loss_type="m2po", generation_backend="vllm",
        logging_steps=1,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=math_answer_text_reward, args=args,
        train_dataset=make_arithmetic_dataset(num_train=2000, seed=0)["train"], processing_class=load_tokenizer(),
    )  # fmt: skip
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    quarter = len(rewards) // 4
    gain = sum(rewards[-quarter:]) / quarter - sum(rewards[:quarter]) / quarter
    assert gain >= 0.1, gain
