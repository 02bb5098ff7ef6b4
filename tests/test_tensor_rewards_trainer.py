"""With only tensor-native rewards (and completion logging off), a training step decodes nothing, in the trainer
or in the generation process.

Decodes are caught at both levels of the tokenizer, and in whichever process makes them:

- the Python methods (`decode`, `batch_decode`, `_decode`, `convert_ids_to_tokens`) of a tokenizer subclass;
- the Rust backend (`tokenizer.backend_tokenizer`, held as `_tokenizer`), replaced by a proxy that logs its decode
  paths (`decode`, `decode_batch`, `id_to_token`, and every call on its `decoder` component) and delegates the rest.
  A reward holding the backend can decode without touching the Python methods: only this level sees that.

Both travel to the generation child inside the pickled tokenizer (and inside any reward holding it). Each logged call
appends `pid name` to a file whose path the spies carry with them, so nothing depends on the child's environment.
The spies are armed after the rewards are built (building `MathAnswerReward` legitimately reads the vocabulary) and
before the trainer is. Negative controls: a text reward makes the child decode (both levels log it, from the child's
pid); a tensor reward that decodes through the backend it holds is caught in the child, by the backend level only.
"""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rewards import LengthPenalty, MathAnswerReward, TensorReward, math_answer_text_reward
from trl_async.toy import make_arithmetic_dataset, tiny_model_path

_BaseTokenizer = type(AutoTokenizer.from_pretrained(tiny_model_path()))

BACKEND_DECODE_PATHS = ("decode", "decode_batch", "id_to_token")
PYTHON_DECODE_PATHS = ("decode", "batch_decode", "_decode", "convert_ids_to_tokens")


def _append(path, name):
    if path is not None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {name}\n")


class LoggingBackend:
    """Stands in for a `tokenizers.Tokenizer`: logs its decode paths (and any call on its `decoder`), delegates the
    rest. Pickles with its log path, so a copy in another process logs to the same file."""

    def __init__(self, inner, name="backend"):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "log_path", None)

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        name = f"{self._name}.{attr}"
        if attr == "decoder" and value is not None:
            component = LoggingBackend(value, name)
            object.__setattr__(component, "log_path", self.log_path)
            return component
        if callable(value) and (attr in BACKEND_DECODE_PATHS or self._name.endswith(".decoder")):

            def logged(*args, **kwargs):
                _append(self.log_path, name)
                return value(*args, **kwargs)

            return logged
        return value

    def __setattr__(self, attr, value):
        setattr(self._inner, attr, value)

    def __getstate__(self):
        return {"inner": self._inner, "name": self._name, "log_path": self.log_path}

    def __setstate__(self, state):
        object.__setattr__(self, "_inner", state["inner"])
        object.__setattr__(self, "_name", state["name"])
        object.__setattr__(self, "log_path", state["log_path"])


def _logged_method(name):
    def method(self, *args, **kwargs):
        _append(self.__dict__.get("decode_log_path"), name)
        return getattr(super(LoggingTokenizer, self), name)(*args, **kwargs)

    method.__name__ = name
    return method


LoggingTokenizer = type(
    "LoggingTokenizer", (_BaseTokenizer,), {name: _logged_method(name) for name in PYTHON_DECODE_PATHS}
)
LoggingTokenizer.__module__ = __name__  # pickled by reference: the child imports this module


def logging_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.__dict__["_tokenizer"] = LoggingBackend(tokenizer.__dict__["_tokenizer"])
    tokenizer.__class__ = LoggingTokenizer
    return tokenizer


def arm(tokenizer, path):
    tokenizer.__dict__["decode_log_path"] = str(path)
    object.__setattr__(tokenizer.__dict__["_tokenizer"], "log_path", str(path))


class DecodesThroughTheBackend(TensorReward):
    """A tensor reward that cheats: it decodes with the backend it kept from construction, never calling the
    tokenizer's Python methods."""

    def __init__(self, tokenizer):
        super().__init__()
        self.backend = tokenizer.backend_tokenizer

    def score(self, completion_ids, completion_mask, **columns):
        texts = self.backend.decode_batch(completion_ids.tolist(), skip_special_tokens=True)
        return torch.tensor([float(len(t) > 0) for t in texts])


def run(tmp_path, reward_funcs_factory):
    log_file = tmp_path / "decodes.txt"
    log_file.write_text("")
    tokenizer = logging_tokenizer()
    reward_funcs = reward_funcs_factory(tokenizer)
    arm(tokenizer, log_file)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=24, logging_steps=1, report_to="none",
                           save_strategy="no", bf16=False, log_completions=False,
                           trainer_generates_while_starting=False)  # the generation process makes every batch  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=8)["train"],
        processing_class=tokenizer,
    )
    trainer.train()
    assert sum("reward" in h for h in trainer.state.log_history) == 2
    return [(int(pid), name) for pid, name in (line.split() for line in log_file.read_text().splitlines())]


def test_tensor_rewards_only_decode_nothing(tmp_path):
    calls = run(tmp_path, lambda tok: [MathAnswerReward(tok), LengthPenalty(max_length=24)])
    assert calls == []


def test_a_text_reward_makes_the_generator_decode(tmp_path):
    calls = run(tmp_path, lambda tok: [MathAnswerReward(tok), math_answer_text_reward])
    assert calls, "the text reward needs decoded completions"
    pids = {pid for pid, _ in calls}
    assert os.getpid() not in pids  # decoding happens in the generation process, off the trainer's critical path
    # Both levels see the child's decode: the Python method, and the backend call it makes.
    names = {name for _, name in calls}
    assert "batch_decode" in names and names & {"backend.decode", "backend.decode_batch"}, names
    # One batch_decode per generation batch, shared by every text reward: 2 batches trained on, and with
    # max_staleness=1 at most 2 more generated ahead before the run stopped.
    assert 2 <= sum(name == "batch_decode" for _, name in calls) <= 4


def test_a_decode_through_the_backend_is_caught_in_the_generator(tmp_path):
    calls = run(tmp_path, lambda tok: [MathAnswerReward(tok), DecodesThroughTheBackend(tok)])
    assert calls, "the backend spy must see the reward's decode_batch"
    assert {name for _, name in calls} == {"backend.decode_batch"}  # invisible to the Python-level methods
    assert os.getpid() not in {pid for pid, _ in calls}  # and it happened in the generation child


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_bad_tensor_reward_output_names_the_function(tmp_path, bad):
    from trl_async.rewards import tensor_reward
    from trl_async.rollout import GeneratorError

    @tensor_reward
    def broken_reward(completion_ids, completion_mask, **kwargs):
        if bad == "shape":
            return torch.zeros(completion_ids.size(0) + 1)
        return torch.zeros(completion_ids.size(0), dtype=torch.long)

    with pytest.raises(GeneratorError, match="broken_reward"):
        run(tmp_path, lambda tok: [broken_reward])
