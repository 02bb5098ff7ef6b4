"""With only tensor-native rewards (and completion logging off), a training step decodes nothing, in the trainer
or in the generation process. Decode calls are counted by a tokenizer subclass that both processes use."""

import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.assets import tiny_model_path
from trl_async.data import make_arithmetic_dataset
from trl_async.rewards import LengthPenalty, MathAnswerReward, math_answer_text_reward

_BaseTokenizer = type(AutoTokenizer.from_pretrained(tiny_model_path()))


class CountingTokenizer(_BaseTokenizer):
    """Appends one line per decode/batch_decode call to $DECODE_COUNT_FILE, from whichever process calls."""

    def _record(self, name):
        with open(os.environ["DECODE_COUNT_FILE"], "a") as f:
            f.write(f"{os.getpid()} {name}\n")

    def decode(self, *args, **kwargs):
        self._record("decode")
        return super().decode(*args, **kwargs)

    def batch_decode(self, *args, **kwargs):
        self._record("batch_decode")
        return super().batch_decode(*args, **kwargs)


def run(tmp_path, monkeypatch, reward_funcs_factory):
    count_file = tmp_path / "decodes.txt"
    count_file.write_text("")
    monkeypatch.setenv("DECODE_COUNT_FILE", str(count_file))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.__class__ = CountingTokenizer
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=24, logging_steps=1, report_to="none",
                           save_strategy="no", bf16=False, log_completions=False,
                           trainer_generates_while_starting=False)  # the generation process makes every batch  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=reward_funcs_factory(tokenizer),
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=8)["train"],
        processing_class=tokenizer,
    )
    trainer.train()
    assert sum("reward" in h for h in trainer.state.log_history) == 2
    return [line.split() for line in count_file.read_text().splitlines()]


def test_tensor_rewards_only_decode_nothing(tmp_path, monkeypatch):
    calls = run(tmp_path, monkeypatch, lambda tok: [MathAnswerReward(tok), LengthPenalty(max_length=24)])
    assert calls == []


def test_a_text_reward_makes_the_generator_decode(tmp_path, monkeypatch):
    calls = run(tmp_path, monkeypatch, lambda tok: [MathAnswerReward(tok), math_answer_text_reward])
    assert calls, "the text reward needs decoded completions"
    pids = {int(pid) for pid, _ in calls}
    assert os.getpid() not in pids  # decoding happens in the generation process, off the trainer's critical path
    # One batch_decode per generation batch, shared by every text reward: 2 batches trained on, and with
    # max_staleness=1 at most 2 more generated ahead before the run stopped.
    assert 2 <= sum(name == "batch_decode" for _, name in calls) <= 4


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_bad_tensor_reward_output_names_the_function(tmp_path, monkeypatch, bad):
    import torch

    from trl_async.rewards import tensor_reward
    from trl_async.rollout import GeneratorError

    @tensor_reward
    def broken_reward(completion_ids, completion_mask, **kwargs):
        if bad == "shape":
            return torch.zeros(completion_ids.size(0) + 1)
        return torch.zeros(completion_ids.size(0), dtype=torch.long)

    with pytest.raises(GeneratorError, match="broken_reward"):
        run(tmp_path, monkeypatch, lambda tok: [broken_reward])
