"""Bad input, as a user would write it: each case ends in a clear error that names the setting, column, file or id
at fault (and says what to do), raised before the generation process starts wherever it can be checked there, and
leaves no generation process and no spool folder in /dev/shm behind (issue 25, item 6).

Each case runs what a user writes (a config, a dataset, rewards, a trainer over the bundled tiny model, `train()`)
and says where it must stop:

- `config`: building the config or a reward object;
- `construct`: inside `AsyncGRPOTrainer(...)`;
- `train`: inside `train()`, before any generation process starts;
- `batch`: at the first batch (a reward's output, a prompt of a streamed dataset): the generation process has
  started, and must be gone afterwards.

Only `batch` cases train (one batch); the others never start a generation process, and that is asserted.

`docs/errors.md` lists every case with the first line of its message, as the code words it:
`python tests/test_bad_inputs.py --write-docs` runs the cases and rewrites that table, and
`test_docs_list_every_case_with_its_message` fails when the table and the code drift apart.
"""

from __future__ import annotations

if __name__ == "__main__":  # --write-docs: the environment pytest runs the cases in (offline, one thread)
    import conftest  # noqa: F401

import dataclasses
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.support.trainer_utils import pid_is_gone, shm_entries
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncPPOConfig, AsyncPPOTrainer
from trl_async.rewards import (
    FormatReward,
    LengthPenalty,
    MathAnswerReward,
    TensorReward,
    TokenPatternReward,
    tensor_reward,
)
from trl_async.rollout import GeneratorError
from trl_async.rollout.pipeline import RolloutPipeline
from trl_async.toy import tiny_model_path
from trl_async.toy.tools import make_multiplication_dataset, multiply, tiny_tools_model_path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
TABLE_START, TABLE_END = "<!-- cases: start -->", "<!-- cases: end -->"
NO_SUCH_HUB_ID = "trl-async-tests/no-such-model"


# ----------------------------------------------------------------------------------------------- rewards a user writes
def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def needs_answer(completions, answer, **kwargs):
    return [1.0] * len(completions)


def raises_on_row_3(completions, **kwargs):
    return [1.0 / (row - 3) for row in range(len(completions))]


def infinite_text_reward(completions, **kwargs):
    return [float("inf")] * len(completions)


def one_reward_only(completions, **kwargs):
    return [1.0]


def returns_strings(completions, **kwargs):
    return ["1"] * len(completions)


def returns_none_for_every_row(completions, **kwargs):
    return [None] * len(completions)


@tensor_reward
def two_columns(completion_ids, completion_mask, **columns):
    return torch.zeros(completion_ids.shape[0], 2)


@tensor_reward
def token_count(completion_ids, completion_mask, **columns):
    return completion_mask.sum(1)


@tensor_reward
def on_another_device(completion_ids, completion_mask, **columns):
    return torch.zeros(completion_ids.shape[0], device="meta")


@tensor_reward
def positive_infinity(completion_ids, completion_mask, **columns):
    return torch.full((completion_ids.shape[0],), float("inf"))


@tensor_reward
def negative_infinity_on_row_1(completion_ids, completion_mask, **columns):
    rewards = torch.zeros(completion_ids.shape[0])
    rewards[1] = float("-inf")
    return rewards


# ----------------------------------------------------------------------------------------------- agentic code a user writes
def _hanging_multiply(a: int, b: int) -> int:
    time.sleep(30)  # far past tool_timeout
    return a * b


_hanging_multiply.__name__ = "multiply"  # the tool the tools model calls
_hanging_multiply.__doc__ = multiply.__doc__


class Sandbox:
    def reset(self, **kwargs):
        raise ValueError("problem bank empty")


class QuotaBoundSandbox:
    """Builds in the trainer (TRL's probe instance), not in the generation process (a child process)."""

    def __init__(self):
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise OSError("no sandbox quota left")

    def reset(self, **kwargs):
        return None


def unreachable_agent_server(prompts, trainer):
    raise ConnectionError("agent server unreachable")


def reads_the_trainer(prompts, trainer):
    return trainer.vllm_generation


def without_logprobs(prompts, trainer):
    prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
    completion_ids, _ = trainer.generate(prompt_ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


class TargetReward(TensorReward):
    def score(self, completion_ids, completion_mask, target, **columns):
        return torch.tensor(target, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- the user
class User:
    """Writes what a user writes, over the bundled tiny model, and records how far it got (`stage`)."""

    def __init__(self, tmp: Path, checkpoint: Path | None = None):
        self.tmp, self._checkpoint, self.stage = tmp, checkpoint, "config"

    def config(self, config_cls=AsyncGRPOConfig, **overrides) -> AsyncGRPOConfig:
        settings = dict(
            output_dir=str(self.tmp / "out"),
            max_steps=2,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            bf16=False,
            use_cpu=True,
        )
        return config_cls(**{**settings, **overrides})

    @staticmethod
    def dataset(prompts=None, **columns) -> Dataset:
        prompts = [f"{i}+{i}=" for i in range(16)] if prompts is None else prompts
        return Dataset.from_dict({"prompt": prompts, **columns})

    def trainer(self, reward_funcs=(constant_reward,), args=None, dataset=None, model=None, **kwargs):
        args = args if args is not None else self.config()
        dataset = self.dataset() if dataset is None else dataset
        self.stage = "construct"
        trainer = AsyncGRPOTrainer(
            model=model if model is not None else tiny_model_path(),
            reward_funcs=list(reward_funcs) if isinstance(reward_funcs, tuple) else reward_funcs,
            args=args,
            train_dataset=dataset,
            **kwargs,
        )
        self.stage = "train"
        return trainer

    def train(self, resume=None, **kwargs):
        self.trainer(**kwargs).train(resume_from_checkpoint=resume)

    def train_with_generate_replaced(self):
        """`trainer.model.generate` patched on the instance, as TRL's own tool tests do, then `train()`."""
        trainer = self.trainer()
        with mock.patch.object(trainer.model, "generate", side_effect=AssertionError("the patched generate ran")):
            trainer.train()

    def train_with_the_tools_model(self, **kwargs):
        """The tools variant of the tiny model (which calls its `multiply` tool) on multiplication problems."""
        args = self.config(max_completion_length=48, max_steps=3, **kwargs.pop("config", {}))
        dataset = make_multiplication_dataset(num_train=16, num_test=0, seed=3)["train"]
        self.train(model=tiny_tools_model_path(), args=args, dataset=dataset, **kwargs)

    def ppo_trainer(self, **kwargs):
        self.stage = "construct"
        AsyncPPOTrainer(
            model=tiny_model_path(),
            reward_funcs=[constant_reward],
            args=self.config(config_cls=AsyncPPOConfig),
            train_dataset=self.dataset(),
            **kwargs,
        )

    def checkpoint(self) -> Path:
        """A copy of a real checkpoint of this tiny job (one step, `save_steps=1`), to tamper with."""
        copy = self.tmp / "resumed" / "checkpoint-1"
        shutil.copytree(self._checkpoint, copy)
        return copy


def tokenizer_without_eos():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    return tokenizer


def model_with_another_shape():
    config = AutoConfig.from_pretrained(tiny_model_path())
    config.hidden_size, config.intermediate_size = 64, 128
    return AutoModelForCausalLM.from_config(config)


def corrupt(checkpoint: Path, text: str) -> Path:
    (checkpoint / "trl_async_rollout.json").write_text(text)
    return checkpoint


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ----------------------------------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    what: str  # the input, in docs/errors.md's words
    run: Callable[[User], object]
    error: type[BaseException]
    names: tuple[str, ...]  # what the message's first line must name: the setting, column, file or id
    when: str  # "config", "construct", "train" or "batch" (see the module docstring)
    source: str = "trl_async"  # whose check it is: "trl_async", or the library whose own clear error surfaces
    skip: Callable[[], str | None] = lambda: None  # a reason to skip here (a vLLM install, a GPU that exists)
    # Whether this machine gives the message docs/errors.md quotes (some messages name what the machine lacks).
    message_is_documented_here: Callable[[], bool] = lambda: True


C = Case
CASES = [
    # --- config values out of range
    C("max_staleness_negative", "`max_staleness=-1`", lambda u: u.config(max_staleness=-1), ValueError,
      ("max_staleness",), "config"),
    C("weight_sync_steps_zero", "`weight_sync_steps=0`", lambda u: u.config(weight_sync_steps=0), ValueError,
      ("weight_sync_steps",), "config"),
    C("weight_sync_beyond_staleness", "`weight_sync_steps=3` with `max_staleness=1`",
      lambda u: u.config(max_staleness=1, weight_sync_steps=3), ValueError, ("weight_sync_steps", "max_staleness"),
      "config"),
    C("queue_capacity_zero", "`queue_capacity=0`", lambda u: u.config(queue_capacity=0), ValueError,
      ("queue_capacity",), "config"),
    C("generation_num_threads_zero", "`generation_num_threads=0`", lambda u: u.config(generation_num_threads=0),
      ValueError, ("generation_num_threads",), "config"),
    C("heartbeat_timeout_zero", "`generator_heartbeat_timeout=0`",
      lambda u: u.config(generator_heartbeat_timeout=0), ValueError, ("generator_heartbeat_timeout",), "config"),
    C("generation_backend_unknown", "`generation_backend='tgi'`", lambda u: u.config(generation_backend="tgi"),
      ValueError, ("generation_backend",), "config"),
    C("loss_type_unknown", "`loss_type='ppo2'`", lambda u: u.config(loss_type="ppo2"), ValueError, ("loss_type",),
      "config"),
    C("m2po_threshold_zero", "`loss_type='m2po'`, `m2po_threshold=0`",
      lambda u: u.config(loss_type="m2po", m2po_threshold=0.0), ValueError, ("m2po_threshold",), "config"),
    C("num_generations_one", "`num_generations=1`", lambda u: u.config(num_generations=1), ValueError,
      ("generations per prompt",), "config", source="TRL"),
    C("batch_not_divisible", "`per_device_train_batch_size=6` with `num_generations=4`",
      lambda u: u.config(per_device_train_batch_size=6), ValueError, ("generation_batch_size", "num_generations"),
      "config", source="TRL"),
    C("temperature_zero", "`temperature=0`", lambda u: u.trainer(args=u.config(temperature=0.0)), ValueError,
      ("temperature",), "construct"),
    C("top_p_out_of_range", "`top_p=1.5`", lambda u: u.trainer(args=u.config(top_p=1.5)), ValueError, ("top_p",),
      "construct"),
    C("top_k_negative", "`top_k=-3`", lambda u: u.trainer(args=u.config(top_k=-3)), ValueError, ("top_k",),
      "construct"),
    C("max_completion_length_zero", "`max_completion_length=0`",
      lambda u: u.trainer(args=u.config(max_completion_length=0)), ValueError, ("max_completion_length",),
      "construct"),
    C("rows_per_decode_below_a_batch", "`max_rows_per_decode=4` with generation batches of 8 rows",
      lambda u: u.config(max_rows_per_decode=4), ValueError, ("max_rows_per_decode=4", "8 rows"), "config"),
    C("rows_per_decode_not_a_number", "`max_rows_per_decode='many'`",
      lambda u: u.config(max_rows_per_decode="many"), ValueError, ("max_rows_per_decode",), "config"),
    C("rows_per_decode_with_fixed_staleness", "`fixed_staleness=2` with `max_rows_per_decode=16`",
      lambda u: u.config(fixed_staleness=2, max_rows_per_decode=16), ValueError,
      ("fixed_staleness", "max_rows_per_decode=16"), "config"),
    C("continuous_batching_async", "TRL's `use_transformers_continuous_batching=True` with asynchronous generation",
      lambda u: u.config(use_transformers_continuous_batching=True), ValueError,
      ("use_transformers_continuous_batching=True", "async_generation=False"), "config"),
    C("cuda_graphs_unknown", "`generation_cuda_graphs='yes'`", lambda u: u.config(generation_cuda_graphs="yes"),
      ValueError, ("generation_cuda_graphs",), "config"),
    C("cuda_graphs_with_vllm", "`generation_cuda_graphs='on'` with `generation_backend='vllm'`",
      lambda u: u.config(generation_cuda_graphs="on", generation_backend="vllm"), ValueError,
      ("generation_cuda_graphs='on'", "generation_backend='hf'"), "config"),
    # --- devices and backends
    C("cuda_graphs_on_a_cpu", "`generation_cuda_graphs='on'` with the generation process on a CPU",
      lambda u: u.trainer(args=u.config(generation_cuda_graphs="on", generation_device="cpu")), ValueError,
      ("generation_cuda_graphs='on'", "cpu"), "construct"),
    C("generation_device_unknown", "`generation_device='gpu0'`",
      lambda u: u.trainer(args=u.config(generation_device="gpu0")), ValueError, ("generation_device",),
      "construct"),
    C("generation_device_absent", "`generation_device='cuda:99'` (no such device here)",
      lambda u: u.trainer(args=u.config(generation_device="cuda:99")), ValueError, ("generation_device",),
      "construct", message_is_documented_here=lambda: not torch.cuda.is_available()),  # (docs: a CPU machine's)
    C("vllm_not_installed", "`generation_backend='vllm'` without vLLM installed",
      lambda u: u.trainer(args=u.config(generation_backend="vllm")), ImportError, ("generation_backend='vllm'",),
      "construct", skip=lambda: "vLLM is installed here" if vllm_installed() else None),
    C("use_vllm_not_installed", "TRL's `use_vllm=True` without vLLM installed",
      lambda u: u.trainer(args=u.config(use_vllm=True)), ImportError, ("use_vllm=True",), "construct",
      skip=lambda: "vLLM is installed here" if vllm_installed() else None),
    # --- models
    C("model_id_offline", "a model id that is neither cached nor reachable (offline)",
      lambda u: u.trainer(model=NO_SUCH_HUB_ID), OSError, (NO_SUCH_HUB_ID,), "construct"),
    C("model_path_missing", "a model path that does not exist", lambda u: u.trainer(model="/no/such/model"),
      OSError, ("/no/such/model",), "construct"),
    C("reward_model_id_offline", "a reward model id that is neither cached nor reachable",
      lambda u: u.trainer(reward_funcs=[NO_SUCH_HUB_ID]), OSError, ("reward_funcs[0]", NO_SUCH_HUB_ID),
      "construct"),
    # --- reward functions given to the trainer
    C("reward_not_callable", "`reward_funcs=[f, 5]`", lambda u: u.trainer(reward_funcs=[constant_reward, 5]),
      TypeError, ("reward_funcs[1]",), "construct"),
    C("no_reward", "`reward_funcs=[]`", lambda u: u.trainer(reward_funcs=[]), ValueError, ("reward_funcs",),
      "construct", source="TRL"),
    C("reward_weights_length", "`reward_weights=[1.0, 2.0]` for one reward",
      lambda u: u.trainer(args=u.config(reward_weights=[1.0, 2.0])), ValueError, ("reward weights",), "construct",
      source="TRL"),
    C("text_reward_missing_column", "a text reward `f(completions, answer, **kw)`, no `answer` column",
      lambda u: u.trainer(reward_funcs=[needs_answer]), ValueError, ("reward_funcs[0]", "needs_answer", "'answer'"),
      "construct"),
    C("math_answer_reward_missing_column", "`MathAnswerReward(tokenizer)`, no `answer` column",
      lambda u: u.trainer(reward_funcs=[MathAnswerReward(AutoTokenizer.from_pretrained(tiny_model_path()))]),
      ValueError, ("math_answer_reward", "'answer'"), "construct"),
    C("tensor_reward_missing_column", "a `TensorReward` whose `score` takes `target`, no `target` column",
      lambda u: u.trainer(reward_funcs=[TargetReward()]), ValueError, ("target_reward", "'target'"), "construct"),
    # --- datasets
    C("no_prompt_column", "a dataset without a `prompt` column (`question` instead)",
      lambda u: u.trainer(dataset=Dataset.from_dict({"question": ["1+1="] * 16})), ValueError,
      ("'prompt' column", "question"), "construct"),
    C("empty_prompt", "an empty prompt (`''`) in row 15",
      lambda u: u.trainer(dataset=u.dataset(["1+1="] * 15 + [""])), ValueError, ("row 15", "'prompt'"),
      "construct"),
    C("prompt_none", "`None` as the prompt of row 3",
      lambda u: u.trainer(dataset=u.dataset(["1+1="] * 3 + [None] + ["1+1="] * 12)), ValueError, ("row 3",),
      "construct"),
    C("prompt_not_text", "integers as prompts",
      lambda u: u.trainer(dataset=u.dataset(list(range(16)))), ValueError, ("row 0", "'prompt'"), "construct"),
    C("empty_conversation", "an empty conversation (`[]`) as a prompt",
      lambda u: u.trainer(dataset=u.dataset([[]] * 16)), ValueError, ("row 0", "empty conversation"), "construct"),
    C("empty_dataset", "a dataset with no rows", lambda u: u.trainer(dataset=u.dataset([])), ValueError,
      ("train_dataset",), "construct"),
    C("too_few_prompts", "1 prompt for generation batches of 2 prompts x 4 generations",
      lambda u: u.trainer(dataset=u.dataset(["1+1="])), ValueError,
      ("generation_batch_size", "num_generations"), "construct"),
    C("prompt_longer_than_context", "a prompt of 1,000 tokens for a 256-token model",
      lambda u: u.trainer(dataset=u.dataset(["1+1= " * 200] * 16)), ValueError, ("row 0", "context"),
      "construct"),
    C("prompt_longer_than_context_streamed", "the same prompt in a streamed (iterable) dataset",
      lambda u: u.train(dataset=u.dataset(["1+1= " * 200] * 16).to_iterable_dataset()), ValueError,
      ("prompt of this batch", "context"), "batch"),
    C("empty_prompt_streamed_generation_process", "an empty prompt in a streamed dataset, met by the generation "
      "process (`trainer_generates_while_starting=False`)",
      lambda u: u.train(dataset=u.dataset([""] * 16).to_iterable_dataset(),
                        args=u.config(trainer_generates_while_starting=False)),
      GeneratorError, ("ValueError", "row of this batch", "'prompt'"), "batch"),
    # --- tokenizers
    C("tokenizer_without_eos_or_pad", "a tokenizer without EOS and pad tokens",
      lambda u: u.trainer(processing_class=tokenizer_without_eos()), ValueError, ("eos_token",), "construct"),
    # --- reward objects built with the wrong argument types
    C("math_answer_reward_model_id", "`MathAnswerReward('Qwen/Qwen2.5-0.5B')` (an id, not a tokenizer)",
      lambda u: MathAnswerReward("Qwen/Qwen2.5-0.5B"), TypeError, ("MathAnswerReward(tokenizer=",), "config"),
    C("format_reward_tokenizer_name", "`FormatReward('qwen')`", lambda u: FormatReward("qwen"), TypeError,
      ("FormatReward(tokenizer=",), "config"),
    C("token_pattern_float_ids", "`TokenPatternReward(pattern=[1.5, 2])`",
      lambda u: TokenPatternReward(pattern=[1.5, 2]), TypeError, ("pattern", "1.5"), "config"),
    C("token_pattern_eos_token_name", "`TokenPatternReward(pattern=[1], eos_token_id='</s>')`",
      lambda u: TokenPatternReward(pattern=[1], eos_token_id="</s>"), TypeError, ("eos_token_id", "'</s>'"),
      "config"),
    C("length_penalty_text_length", "`LengthPenalty(max_length='1024')`",
      lambda u: LengthPenalty(max_length="1024"), TypeError, ("max_length",), "config"),
    C("length_penalty_cache_too_long", "`LengthPenalty(max_length=100, cache_length=200)`",
      lambda u: LengthPenalty(max_length=100, cache_length=200), ValueError, ("cache_length",), "config"),
    C("tensor_reward_non_function", "`tensor_reward(5)`", lambda u: tensor_reward(5), TypeError,
      ("@tensor_reward",), "config"),
    # --- resuming
    C("resume_missing_folder", "`resume_from_checkpoint` naming a folder that does not exist",
      lambda u: u.train(resume=str(u.tmp / "nope")), ValueError, ("checkpoint", "nope"), "train",
      source="transformers"),
    C("resume_corrupt_rollout_state", "a checkpoint whose `trl_async_rollout.json` is cut short",
      lambda u: u.train(resume=str(corrupt(u.checkpoint(), '{"ranks": ['))), ValueError,
      ("checkpoint-1/trl_async_rollout.json",), "train"),
    C("resume_rollout_state_of_something_else", "a checkpoint whose `trl_async_rollout.json` holds other JSON",
      lambda u: u.train(resume=str(corrupt(u.checkpoint(), '{"step": 3}'))), ValueError,
      ("checkpoint-1/trl_async_rollout.json",), "train"),
    C("resume_run_with_other_settings", "a checkpoint of a run with another batch size",
      lambda u: u.train(resume=str(u.checkpoint()), args=u.config(per_device_train_batch_size=16)), ValueError,
      ("checkpoint-1/trl_async_rollout.json", "generation_batch_size"), "train"),
    C("resume_other_model", "a checkpoint of another model (other hidden size)",
      lambda u: u.train(resume=str(u.checkpoint()), model=model_with_another_shape(),
                        processing_class=AutoTokenizer.from_pretrained(tiny_model_path())),
      ValueError, ("resume_from_checkpoint", "checkpoint-1", "hidden_size"), "train"),
    # --- what rewards return (checked at every batch)
    C("tensor_reward_wrong_shape", "a tensor reward returning shape `(B, 2)`",
      lambda u: u.train(reward_funcs=[two_columns]), ValueError, ("'two_columns'", "shape"), "batch"),
    C("tensor_reward_int_dtype", "a tensor reward returning an int tensor",
      lambda u: u.train(reward_funcs=[token_count]), TypeError, ("'token_count'", "int64"), "batch"),
    C("tensor_reward_wrong_device", "a tensor reward returning a tensor on another device",
      lambda u: u.train(reward_funcs=[on_another_device]), ValueError, ("'on_another_device'", "meta"), "batch"),
    C("tensor_reward_inf", "a tensor reward returning +inf",
      lambda u: u.train(reward_funcs=[positive_infinity]), ValueError, ("'positive_infinity'", "inf"), "batch"),
    C("tensor_reward_negative_inf", "a tensor reward returning -inf for row 1",
      lambda u: u.train(reward_funcs=[negative_infinity_on_row_1]), ValueError,
      ("'negative_infinity_on_row_1'", "-inf", "completion 1"), "batch"),
    C("text_reward_inf", "a text reward returning +inf", lambda u: u.train(reward_funcs=[infinite_text_reward]),
      ValueError, ("'infinite_text_reward'", "inf"), "batch"),
    C("text_reward_wrong_length", "a text reward returning 1 value for 8 completions",
      lambda u: u.train(reward_funcs=[one_reward_only]), ValueError, ("'one_reward_only'", "1 rewards"), "batch"),
    C("text_reward_returns_strings", "a text reward returning strings",
      lambda u: u.train(reward_funcs=[returns_strings]), TypeError, ("'returns_strings'", "str"), "batch"),
    C("text_reward_raises", "a text reward raising on row 3",
      lambda u: u.train(reward_funcs=[raises_on_row_3]), ZeroDivisionError, ("'raises_on_row_3'", "return None"),
      "batch"),
    C("text_reward_raises_in_generation_process", "the same, met by the generation process",
      lambda u: u.train(reward_funcs=[raises_on_row_3], args=u.config(trainer_generates_while_starting=False)),
      GeneratorError, ("ZeroDivisionError", "'raises_on_row_3'", "return None"), "batch"),
    C("tensor_reward_wrong_shape_in_generation_process", "a tensor reward of shape `(B, 2)`, met by the generation "
      "process", lambda u: u.train(reward_funcs=[two_columns], args=u.config(trainer_generates_while_starting=False)),
      GeneratorError, ("ValueError", "'two_columns'", "shape"), "batch"),
    # --- tools, environments, rollout functions (docs/agentic.md)
    C("tool_timeout_zero", "`tool_timeout=0`", lambda u: u.config(tool_timeout=0), ValueError, ("tool_timeout",),
      "config"),
    C("tools_with_inflight_updates", "`tools=[multiply]` with `inflight_weight_updates=True`",
      lambda u: u.trainer(args=u.config(inflight_weight_updates=True), tools=[multiply]), ValueError,
      ("inflight_weight_updates=True", "tools="), "construct"),
    C("tools_with_vllm_backend", "`tools=[multiply]` with `generation_backend='vllm'`",
      lambda u: u.trainer(args=u.config(generation_backend="vllm"), tools=[multiply]), ValueError,
      ("generation_backend='vllm'", "tools="), "construct"),
    C("ppo_with_tools", "`AsyncPPOTrainer(..., tools=[multiply])`", lambda u: u.ppo_trainer(tools=[multiply]),
      ValueError, ("AsyncPPOTrainer", "tools="), "construct"),
    C("unknown_environment", "a row whose `environment` names none of the dict `environment_factory`'s",
      lambda u: u.train(dataset=u.dataset(environment=["sandbox"] * 15 + ["abacus"]),
                        environment_factory={"sandbox": Sandbox}),
      ValueError, ("environment='abacus'", "environment_factory"), "train"),
    C("generate_replaced_on_the_instance", "`patch.object(trainer.model, \"generate\", ...)` before `train()`",
      lambda u: u.train_with_generate_replaced(), ValueError, ("trainer.model.generate", "async_generation=False"),
      "train"),
    C("tool_hangs", "a tool that does not return within `tool_timeout=1`",
      lambda u: u.train_with_the_tools_model(config=dict(tool_timeout=1.0), tools=[_hanging_multiply]),
      GeneratorError, ("ToolTimeoutError", "tool 'multiply'", "tool_timeout=1s"), "batch"),
    C("environment_reset_raises", "an environment whose `reset` raises",
      lambda u: u.train(environment_factory=Sandbox), GeneratorError,
      ("ValueError", "problem bank empty", "environment (Sandbox).reset"), "batch"),
    C("environment_factory_raises", "an environment factory that raises in the generation process",
      lambda u: u.train(environment_factory=QuotaBoundSandbox), GeneratorError,
      ("OSError", "no sandbox quota left", "environment_factory (QuotaBoundSandbox)"), "batch"),
    C("rollout_func_raises", "a `rollout_func` that raises", lambda u: u.train(rollout_func=unreachable_agent_server),
      GeneratorError, ("ConnectionError", "rollout_func 'unreachable_agent_server'"), "batch"),
    C("rollout_func_reads_the_trainer", "a `rollout_func` reading `trainer.vllm_generation`",
      lambda u: u.train(rollout_func=reads_the_trainer), GeneratorError,
      ("AttributeError", "trainer.vllm_generation", "RolloutContext"), "batch"),
    C("rollout_func_without_logprobs", "a `rollout_func` returning `logprobs=None`",
      lambda u: u.train(rollout_func=without_logprobs), GeneratorError, ("rollout_func", "logprobs=None"), "batch"),
]  # fmt: skip
STAGE_OF = {"config": "config", "construct": "construct", "train": "train", "batch": "train"}


def first_line(error: BaseException) -> str:
    """The first line of the message, with the notes Python prints under it (a raising reward's name)."""
    lines = str(error).strip().splitlines()
    return "\n".join([lines[0] if lines else "", *map(str, getattr(error, "__notes__", None) or [])]).strip()


def documented_form(line: str, tmp: Path) -> str:
    """The message as docs/errors.md shows it: this run's temporary folder and pids replaced by placeholders."""
    line = line.replace(str(tmp), "{tmp}")
    line = re.sub(r"pid \d+", "pid {pid}", line)
    return line.replace("|", "\\|").replace("\n", "<br>")


# ----------------------------------------------------------------------------------------------- running a case
def make_checkpoint(folder: Path) -> Path:
    """A real checkpoint of the tiny job after one step (what the resume cases tamper with)."""
    user = User(folder)
    user.trainer(args=user.config(max_steps=1, save_strategy="steps", save_steps=1)).train()
    return folder / "out" / "checkpoint-1"


def run_case(case: Case, tmp: Path, checkpoint: Path | None) -> tuple[BaseException, str]:
    """Runs the case; returns its exception and the stage it reached. Fails if nothing (or something else) raised."""
    user = User(tmp, checkpoint)
    with pytest.raises(case.error) as raised:
        case.run(user)
    return raised.value, user.stage


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture
def generation_processes(monkeypatch):
    """Every generation process a case starts, with its spool folder: the real `RolloutPipeline.start`, recorded."""
    started = []
    start = RolloutPipeline.start

    def recording_start(self, *args, **kwargs):
        try:
            return start(self, *args, **kwargs)
        finally:
            started.append((self.process, None if self.queue is None else self.queue.spool_dir))

    monkeypatch.setattr(RolloutPipeline, "start", recording_start)
    return started


def documented_rows() -> dict[str, list[str]]:
    """docs/errors.md's table: case id -> its cells (Case, Input, Raised, When, Check, Message)."""
    text = DOCS.read_text()
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    rows = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]] for row in rows]
    return {row[0].strip("`"): row for row in cells}


def documented_messages() -> dict[str, str]:
    return {case_id: cells[-1] for case_id, cells in documented_rows().items()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_clear_error_and_leaves_nothing_behind(case, tmp_path, checkpoint, generation_processes):
    reason = case.skip()
    if reason:
        pytest.skip(reason)
    torch_shm = f"torch_{os.getpid()}_"
    before = {e for e in shm_entries() if e.startswith(torch_shm)}
    error, stage = run_case(case, tmp_path, checkpoint if case.id.startswith("resume") else None)
    line = first_line(error)
    for name in case.names:
        assert name in line, f"the message's first line does not name {name!r}: {line!r}"
    assert stage == STAGE_OF[case.when], f"raised while in {stage!r}, expected {case.when!r}: {line!r}"
    if case.when == "batch":
        assert generation_processes, "a batch case must have started the generation process"
    else:
        assert not generation_processes, "a generation process was started before the error"
    for process, spool_dir in generation_processes:
        assert process is None or process.pid is None or pid_is_gone(process.pid)
        assert spool_dir is None or not os.path.exists(spool_dir), f"{spool_dir} left behind"
    assert {e for e in shm_entries() if e.startswith(torch_shm)} <= before
    # The exception and the message in docs/errors.md are these.
    assert documented_rows()[case.id][2] == f"`{type(error).__name__}`", "docs/errors.md names another exception"
    if case.message_is_documented_here():
        assert documented_messages().get(case.id) == documented_form(line, tmp_path), (
            "docs/errors.md is out of date: run `python tests/test_bad_inputs.py --write-docs`"
        )


def test_docs_list_every_case_with_its_message():
    """docs/errors.md's table has a row per case, in order, whose Input, When and Check columns are the case's (the
    Raised and Message columns are checked against what each case raises, above)."""
    rows = documented_rows()
    assert list(rows) == [c.id for c in CASES]
    assert len(CASES) >= 30
    for case in CASES:
        _, what, _, when, source, _ = rows[case.id]
        assert (what, when, source) == (case.what, case.when, case.source), f"docs/errors.md's row of {case.id}"


# ----------------------------------------------------------------------------------------------- not errors
def test_prompt_and_completion_past_the_context_is_a_warning(tmp_path, caplog, generation_processes):
    """A prompt that fits but leaves fewer than max_completion_length tokens of context: a warning at construction
    (free-length runs rely on EOS arriving first), naming both numbers."""
    user = User(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trl_async.config.inputs"):
        user.trainer(dataset=user.dataset(["1+1= " * 50] * 16), args=user.config(max_completion_length=256))
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_async.config.inputs"]
    assert len(warnings) == 1 and "max_completion_length=256" in warnings[0] and "256 tokens" in warnings[0]
    assert not generation_processes


def test_none_rewards_keep_trl_semantics(tmp_path, caplog):
    """None means "not scored", as in TRL: training goes on, TRL's warning names the row, the loss is 0."""
    user = User(tmp_path)
    trainer = user.trainer(reward_funcs=[returns_none_for_every_row], args=user.config(max_steps=1))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert any("All reward functions returned None" in r.getMessage() for r in caplog.records)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [0.0]


# ----------------------------------------------------------------------------------------------- docs/errors.md
def write_docs(only: set[str] | None = None) -> None:
    """Runs every case (or those in `only`, keeping the other rows' messages) and rewrites the table of
    docs/errors.md with the messages the code gives."""
    rows = ["| Case | Input | Raised | When | Check | Message (first line, and notes) |", "|---|---|---|---|---|---|"]
    kept = documented_messages() if TABLE_START in DOCS.read_text() else {}
    kept_errors = {case_id: cells[2] for case_id, cells in documented_rows().items()} if kept else {}
    with tempfile.TemporaryDirectory(prefix="trl_async-errors-") as folder:
        needs_checkpoint = only is None or any(case_id.startswith("resume") for case_id in only)
        checkpoint = make_checkpoint(Path(folder) / "checkpoint") if needs_checkpoint else None
        for index, case in enumerate(CASES):
            if only is not None and case.id not in only and case.id in kept:
                rows.append(
                    f"| `{case.id}` | {case.what} | {kept_errors[case.id]} | {case.when} | {case.source} | "
                    f"{kept[case.id]} |"
                )
                continue
            if case.skip():  # cannot run here: keep what the table says
                rows.append(
                    f"| `{case.id}` | {case.what} | `{case.error.__name__}` | {case.when} | {case.source} | "
                    f"{kept.get(case.id, '')} |"
                )
                continue
            tmp = Path(folder) / f"case{index}"
            tmp.mkdir()
            error, _ = run_case(case, tmp, checkpoint if case.id.startswith("resume") else None)
            message = documented_form(first_line(error), tmp)
            rows.append(
                f"| `{case.id}` | {case.what} | `{type(error).__name__}` | {case.when} | {case.source} | {message} |"
            )
            print(f"{case.id}: {message}", flush=True)
    text = DOCS.read_text()
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    DOCS.write_text(head + TABLE_START + "\n" + "\n".join(rows) + "\n" + TABLE_END + tail)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] != ["--write-docs"] or not (
        len(arguments) == 1 or (len(arguments) == 3 and arguments[1] == "--only")
    ):
        raise SystemExit("usage: python tests/test_bad_inputs.py --write-docs [--only CASE_ID,CASE_ID,...]")
    write_docs(set(arguments[2].split(",")) if len(arguments) == 3 else None)
