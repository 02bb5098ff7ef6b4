"""Tools, environments and rollout functions in the generation process (issue 31; docs/agentic.md), in real
`AsyncGRPOTrainer` runs on the bundled tools model (`trl_async.toy.tiny_tools_model_path()`), which really calls its
`multiply` tool: no mocked generation.

The tools and environments defined here record the process they run in (a file in the test's folder): every call
must come from the generation process, never from the trainer.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

from tests.support.trainer_utils import make_args, pid_is_gone
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncPPOConfig, AsyncPPOTrainer
from trl_async.rewards import math_answer_text_reward
from trl_async.rollout import GeneratorError
from trl_async.rollout.agentic import RolloutContext
from trl_async.rollout.tool_calls import CallTimer, CallWatchdog, FirstRoundCalls, watched
from trl_async.toy import make_arithmetic_dataset, tiny_model_path
from trl_async.toy.tools import make_multiplication_dataset, tiny_tools_model_path

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'rollout_func'", "ignore:You are using 'environment")

MULTIPLY_DOC = """
    Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product of a and b.
    """


def recording_multiply(path: str, raises: str | None = None, first_call_s: float = 0.0):
    """The task's `multiply` tool, appending the pid it runs in to `path` (defined in a function: it travels to the
    generation process by value); its first call takes `first_call_s` seconds."""

    def multiply(a: int, b: int) -> int:
        first = not os.path.exists(path)
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        if first and first_call_s:
            time.sleep(first_call_s)
        if raises is not None:
            raise RuntimeError(raises)
        return a * b

    multiply.__doc__ = MULTIPLY_DOC
    return multiply


def read_pids(path) -> list[int]:
    return [int(line) for line in open(path).read().split()] if os.path.exists(path) else []


class GeneratorPids(TrainerCallback):
    """The pid of the trainer's generation process at every step (it is gone once `train()` returns)."""

    def __init__(self, trainer):
        self.trainer, self.pids = trainer, set()

    def on_step_end(self, args, state, control, **kwargs):
        process = self.trainer._rollout.process
        if process is not None and process.pid is not None:
            self.pids.add(process.pid)


def tools_args(tmp_path, **overrides) -> AsyncGRPOConfig:
    values = dict(
        max_steps=2,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        max_tool_calling_iterations=1,
        learning_rate=1e-4,
        use_cpu=True,
    )
    values.update(overrides)
    return make_args(tmp_path, **values)


def multiplication(num_train=64, seed=5):
    return make_multiplication_dataset(num_train=num_train, num_test=0, seed=seed)["train"]


def tool_messages(completions) -> list[list[dict]]:
    return [[m for m in c if m["role"] == "tool"] for c in completions]


def logged(trainer, key) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


# ----------------------------------------------------------------------------------------------- tools
def test_tools_run_in_the_generation_process_and_the_trainer_trains_on_their_batches(tmp_path):
    calls = str(tmp_path / "calls.txt")
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=tools_args(tmp_path, max_steps=3),
        train_dataset=multiplication(),
        tools=[recording_multiply(calls)],
    )
    generator = GeneratorPids(trainer)
    trainer.add_callback(generator)
    trainer.train()
    pids = read_pids(calls)
    assert pids, "the tools model called no tool in 48 rollouts"
    assert len(generator.pids) == 1 and set(pids) == generator.pids, (set(pids), generator.pids)
    assert os.getpid() not in pids
    # Every batch the trainer trained on came from the generation process, and TRL's tool metrics were logged.
    assert logged(trainer, "async/trainer_generated_batches") == [0.0, 0.0, 0.0]
    frequencies = logged(trainer, "tools/call_frequency")
    assert len(frequencies) == 3 and sum(frequencies) > 0
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0, 0.0]
    # TRL's call frequency is calls per row; the generation process also made batches no step trained on (it runs
    # ahead of the trainer), so the tool counted at least the calls of the three trained batches of 16 rows.
    assert len(pids) >= round(sum(frequencies) * 16)
    assert len(logged(trainer, "async/tool_s")) == sum(f > 0 for f in frequencies)  # time in tools, where any ran
    # The timeline shows the calls as busy `tools` spans of the generation process.
    import json

    events = json.load(open(os.path.join(trainer.args.output_dir, "timeline.json")))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    tools = [e for e in events if e.get("ph") == "X" and e["name"] == "tools"]
    assert tools and all(e["cat"] == "busy" and names[e["pid"]] == "generator rank 0" for e in tools)


def test_tool_metrics_are_logged_for_every_batch_as_trl_logs_them_even_without_a_call(tmp_path):
    """The plain tiny model never calls a tool: TRL logs a call frequency of 0 for each batch (and the trainer's
    gather of the counts runs for every batch on every rank, whatever the batch holds)."""
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.response_template = qwen3_template  # TRL's parser for this format (the bundled tokenizer has none)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(),
        processing_class=tokenizer,
        reward_funcs=math_answer_text_reward,
        args=make_args(tmp_path, max_steps=2, max_completion_length=8),
        train_dataset=make_arithmetic_dataset(num_train=32, num_test=0, seed=4)["train"],
        tools=[recording_multiply(str(tmp_path / "calls.txt"))],
    )
    trainer.train()
    assert logged(trainer, "tools/call_frequency") == [0.0, 0.0]
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    assert read_pids(str(tmp_path / "calls.txt")) == []


def test_a_raising_tool_is_a_failed_call_the_model_reads_and_training_goes_on(tmp_path):
    """TRL's semantics: the exception becomes the tool's result `{'error': ...}`, counted in
    `tools/failure_frequency`; the run continues."""
    calls = str(tmp_path / "calls.txt")
    seen_errors = str(tmp_path / "errors.txt")

    def saw_the_error(completions, **kwargs):  # runs in the generation process, on TRL's messages
        expected = str({"error": "calculator offline"})
        rows = [any(m["content"] == expected for m in messages) for messages in tool_messages(completions)]
        with open(seen_errors, "a") as f:
            f.write(f"{sum(rows)}\n")
        return [float(row) for row in rows]

    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=saw_the_error,
        args=tools_args(tmp_path),
        train_dataset=multiplication(),
        tools=[recording_multiply(calls, raises="calculator offline")],
    )
    trainer.train()
    calls_made = len(read_pids(calls))
    assert calls_made > 0
    assert trainer.state.global_step == 2
    failures = logged(trainer, "tools/failure_frequency")
    frequencies = logged(trainer, "tools/call_frequency")
    assert [f for f, c in zip(failures, frequencies, strict=True) if c > 0] == [1.0] * sum(c > 0 for c in frequencies)
    # Each failed call's error message reached the model as its tool result.
    assert sum(int(n) for n in open(seen_errors).read().split()) == calls_made
    assert sum(logged(trainer, "reward")) > 0


@pytest.fixture
def started_pipelines(monkeypatch):
    """Every generation process a test starts, with its spool folder: the real `RolloutPipeline.start`, recorded."""
    from trl_async.rollout.pipeline import RolloutPipeline

    started, start = [], RolloutPipeline.start

    def recording_start(self, *args, **kwargs):
        try:
            return start(self, *args, **kwargs)
        finally:
            started.append((self.process, None if self.queue is None else self.queue.spool_dir))

    monkeypatch.setattr(RolloutPipeline, "start", recording_start)
    return started


def test_a_hanging_tool_ends_the_run_naming_it_and_leaves_nothing_behind(tmp_path, started_pipelines):
    calls = str(tmp_path / "calls.txt")
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=tools_args(tmp_path, max_steps=3, tool_timeout=1.0),
        train_dataset=multiplication(),
        tools=[recording_multiply(calls, first_call_s=30.0)],  # returns, but far too late
    )
    started = time.monotonic()
    with pytest.raises(GeneratorError, match=r"tool 'multiply' did not return within tool_timeout=1s") as raised:
        trainer.train()
    assert "ToolTimeoutError" in str(raised.value).splitlines()[0]
    assert time.monotonic() - started < 25  # the timeout, not the tool's 30 s, ended it
    [(process, spool_dir)] = started_pipelines
    assert set(read_pids(calls)) == {process.pid}  # the calls ran in the generation process, the run ended with it...
    assert pid_is_gone(process.pid)  # ...which is gone, with its spool in /dev/shm
    assert not os.path.exists(spool_dir)


# ----------------------------------------------------------------------------------------------- environments
def test_environment_factory_without_a_dataset_runs_in_the_generation_process(tmp_path):
    """A single factory, the environment owning the data (`reset` returns the problem) and the reward
    (`get_reward`, a reward column named after the class): instances built, reset and called in the generation
    process, one per rollout."""
    log = str(tmp_path / "environment.txt")

    class Calculator:
        def __init__(self):
            self.answer, self.product = None, None

        def reset(self, **kwargs):
            problem = len(open(log).read().splitlines()) if os.path.exists(log) else 0
            a, b = 101 + problem % 800, 457
            self.answer, self.product = a * b, None
            with open(log, "a") as f:
                f.write(f"reset {os.getpid()} {id(self)} {sorted(kwargs)}\n")
            return f"What is {a}*{b}?"

        def multiply(self, a: int, b: int) -> int:
            self.product = a * b
            with open(log, "a") as f:
                f.write(f"call {os.getpid()} {id(self)}\n")
            return a * b

        def get_reward(self):
            return float(self.product == self.answer)

    Calculator.multiply.__doc__ = MULTIPLY_DOC
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=[],
        args=tools_args(tmp_path, per_device_train_batch_size=8, num_generations=4),
        environment_factory=Calculator,
    )
    generator = GeneratorPids(trainer)
    trainer.add_callback(generator)
    trainer.train()
    records = [line.split(" ", 3) for line in open(log).read().splitlines()]
    resets = [r for r in records if r[0] == "reset"]
    assert {int(r[1]) for r in records} == generator.pids  # built, reset and called in the generation process only
    assert len(resets) >= 16 and all(r[3] == "['prompt']" for r in resets)  # TRL's placeholder row, reset per rollout
    assert len({r[2] for r in resets}) == 8  # one instance per rollout of a batch, reused across batches
    assert any(r[0] == "call" for r in records), "the model called no tool"
    rewards = logged(trainer, "rewards/Calculator/mean")  # `get_reward` found its instances (no NaN, no None)
    assert len(rewards) == 2 and all(r == r for r in rewards)
    assert logged(trainer, "async/trainer_generated_batches") == [0.0, 0.0]


def test_dict_environment_factory_routes_each_row_to_its_environment(tmp_path):
    log = str(tmp_path / "environment.txt")

    class Calculator:
        def reset(self, **kwargs):
            with open(log, "a") as f:
                f.write(f"Calculator {os.getpid()} {'environment' in kwargs} {kwargs['prompt'][-1]['content']}\n")

        def multiply(self, a: int, b: int) -> int:
            with open(log, "a") as f:
                f.write(f"call {os.getpid()} multiply\n")
            return a * b

    class Silent:  # no tool: its rows' prompts carry no tool schema
        def reset(self, **kwargs):
            with open(log, "a") as f:
                f.write(f"Silent {os.getpid()} {'environment' in kwargs} {kwargs['prompt'][-1]['content']}\n")

    Calculator.multiply.__doc__ = MULTIPLY_DOC
    data = multiplication(num_train=32)
    data = data.add_column("environment", ["calculator" if i % 2 else "silent" for i in range(len(data))])
    route = {row["prompt"][-1]["content"]: row["environment"] for row in data}
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=tools_args(tmp_path, per_device_train_batch_size=16, num_generations=4),
        train_dataset=data,
        environment_factory={"calculator": Calculator, "silent": Silent},
    )
    generator = GeneratorPids(trainer)
    trainer.add_callback(generator)
    trainer.train()
    records = [line.split(" ", 3) for line in open(log).read().splitlines()]
    resets = [r for r in records if r[0] != "call"]
    assert {int(r[1]) for r in records} == generator.pids
    assert {r[0] for r in resets} == {"Calculator", "Silent"} and len(resets) >= 32  # 2 steps of 16 rows at least
    assert all(r[2] == "False" for r in resets)  # the routing column is not passed to `reset`
    assert all({"calculator": "Calculator", "silent": "Silent"}[route[r[3]]] == r[0] for r in resets)
    assert any(r[0] == "call" for r in records), "no calculator row called its tool"


def test_an_unknown_environment_name_is_refused_before_the_generation_process_starts(tmp_path):
    class Calculator:
        def reset(self, **kwargs): ...

    data = multiplication(num_train=16).add_column("environment", ["calculator"] * 15 + ["abacus"])
    trainer = AsyncGRPOTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=tools_args(tmp_path, per_device_train_batch_size=8, num_generations=4),
        train_dataset=data,
        environment_factory={"calculator": Calculator},
    )
    with pytest.raises(ValueError, match="environment='abacus'.*not among the environments"):
        trainer.train()
    assert trainer._rollout.process is None


# ----------------------------------------------------------------------------------------------- rollout_func
def test_rollout_func_runs_in_the_generation_process_and_its_extra_fields_reach_the_rewards(tmp_path):
    trainer_pid = os.getpid()

    def rollout(prompts, trainer):
        assert isinstance(trainer, RolloutContext)
        prompt_ids = trainer.processing_class.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        completion_ids, logprobs = trainer.generate(prompt_ids)
        return {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "sampled_tokens": [len(c) for c in completion_ids],  # a list: one value per row
            "sampler_pid": os.getpid(),  # anything else: the same for every row
        }

    def sampled_tokens(completions, sampled_tokens, **kwargs):
        return [float(n) for n in sampled_tokens]

    def elsewhere(completions, sampler_pid, **kwargs):
        return [float(sampler_pid != trainer_pid)] * len(completions)

    trainer = AsyncGRPOTrainer(
        model=tiny_model_path(),
        reward_funcs=[sampled_tokens, elsewhere],
        args=make_args(tmp_path, max_steps=2, max_completion_length=12),
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=0, seed=2)["train"],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path()),
        rollout_func=rollout,
    )
    trainer.train()
    # The reward read each row's length from the rollout function's field: the batch's mean completion length.
    assert logged(trainer, "rewards/sampled_tokens/mean") == pytest.approx(logged(trainer, "completions/mean_length"))
    assert logged(trainer, "rewards/elsewhere/mean") == [1.0, 1.0]
    assert logged(trainer, "async/trainer_generated_batches") == [0.0, 0.0]


def _raising_rollout_func(prompts, trainer):
    raise ConnectionError("agent server unreachable")


# ----------------------------------------------------------------------------------------------- μ and staleness exact
class ToolTracingTrainer(AsyncGRPOTrainer):
    """Checks every batch that enters a loss against an independent recomputation, with TRL's own forward
    (`GRPOTrainer._get_per_token_logps_and_entropies`, not the engine's) and the weights of every version:

    * μ on the model's tokens is the log-prob under the weights that sampled them (some version reproduces it), and
      0.0 on tool tokens (TRL's placeholder);
    * no row older than `max_staleness` (from the version that reproduces μ) reaches a loss;
    * per step, Σδ² and the token count over the model's tokens only, δ = log π_old − log μ (π_old: the weights at the
      loss), for comparison with the logged `offpolicy/delta_sq_before`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights_by_version: dict[int, dict] = {}
        self.staleness: list[int] = []
        self.mu_gaps: list[float] = []
        self.all_gaps: list[dict] = []
        self.tool_tokens = 0
        self.tool_token_mu: list[float] = []
        self.delta_sq: dict[int, tuple[float, int]] = {}
        self._probe = None

    def _logps(self, weights, inputs):
        if self._probe is None:
            import copy

            self._probe = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()
        self._probe.load_state_dict(weights)
        with torch.no_grad():
            logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                self,
                self._probe,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )
        return logps

    def _compute_loss(self, model, inputs):
        if self.model.training:
            version = self.state.global_step
            model_weights = self.accelerator.unwrap_model(self.model).state_dict()
            self.weights_by_version.setdefault(version, {k: v.detach().clone() for k, v in model_weights.items()})
            completion = inputs["completion_mask"].bool()
            model_tokens = completion & inputs["tool_mask"].bool()
            tool_tokens = completion & ~inputs["tool_mask"].bool()
            mu = inputs["sampling_per_token_logps"]
            self.tool_tokens += int(tool_tokens.sum())
            self.tool_token_mu += mu[tool_tokens].tolist()
            gaps = {v: (self._logps(w, inputs) - mu).abs()[model_tokens].max().item()
                    for v, w in self.weights_by_version.items()}  # fmt: skip
            best = min(gaps.values())
            # Versions whose weights did not change (a step without gradient) reproduce μ equally: the newest is it.
            generated_by = max(v for v, gap in gaps.items() if gap <= best + 1e-6)
            self.mu_gaps.append(best)
            self.all_gaps.append(gaps)
            self.staleness.append(version - generated_by)
            delta = (self._logps(self.weights_by_version[version], inputs) - mu)[model_tokens].double()
            total, count = self.delta_sq.get(version + 1, (0.0, 0))
            self.delta_sq[version + 1] = (total + float((delta**2).sum()), count + int(model_tokens.sum()))
        return super()._compute_loss(model, inputs)


def test_mu_staleness_and_offpolicy_figures_stay_exact_with_tool_tokens_masked(tmp_path):
    max_staleness = 1
    trainer = ToolTracingTrainer(
        model=tiny_tools_model_path(),
        reward_funcs=math_answer_text_reward,
        args=tools_args(tmp_path, max_steps=4, learning_rate=3e-3, max_staleness=max_staleness, beta=0.0),
        train_dataset=multiplication(),
        tools=[recording_multiply(str(tmp_path / "calls.txt"))],
    )
    trainer.train()
    assert trainer.tool_tokens > 0, "no batch had tool tokens"
    assert set(trainer.tool_token_mu) == {0.0}  # tool tokens carry no behaviour log-prob
    assert max(trainer.mu_gaps) < 1e-3, trainer.mu_gaps  # μ is the sampling distribution's, token by token
    assert len(trainer.staleness) == 4 and max(trainer.staleness) <= max_staleness, trainer.all_gaps
    assert max(trainer.staleness) == 1  # the generator ran ahead: stale rows did reach the loss
    # The logged second moment of log π_old − log μ is over the model's tokens only (a tool token's δ = log π − 0
    # would dominate it).
    compared = 0
    for entry in trainer.state.log_history:
        if "offpolicy/delta_sq_before" not in entry:
            continue
        total, count = trainer.delta_sq[entry["step"]]
        expected = total / count
        assert entry["offpolicy/delta_sq_before"] == pytest.approx(expected, rel=0.05, abs=1e-9), entry["step"]
        compared += expected > 1e-6
    assert compared >= 1, "no step had a measurable policy lag"


# ----------------------------------------------------------------------------------------------- refusals, settings
@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        (dict(inflight_weight_updates=True), dict(tools=["multiply"]), "inflight_weight_updates=True with tools="),
        (dict(generation_backend="vllm"), dict(rollout_func=_raising_rollout_func), "vLLM backend"),
    ],
    ids=["inflight", "vllm"],
)
def test_what_agentic_runs_do_not_support_is_refused_up_front(tmp_path, config, kwargs, message):
    import multiprocessing

    if "tools" in kwargs:
        kwargs = dict(tools=[recording_multiply(str(tmp_path / "calls.txt"))])
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=message) as raised:
        AsyncGRPOTrainer(
            model=tiny_tools_model_path(),
            reward_funcs=math_answer_text_reward,
            args=tools_args(tmp_path, **config),
            train_dataset=multiplication(num_train=16),
            **kwargs,
        )
    assert "async_generation=False" in str(raised.value)
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_ppo_refuses_tools_environments_and_rollout_funcs(tmp_path):
    for kwargs, name in (
        (dict(tools=[recording_multiply(str(tmp_path / "calls.txt"))]), "tools="),
        (dict(environment_factory=lambda: None), "environment_factory="),
        (dict(rollout_func=_raising_rollout_func), "rollout_func="),
    ):
        with pytest.raises(ValueError, match=f"AsyncPPOTrainer does not support {name}"):
            AsyncPPOTrainer(
                model=tiny_tools_model_path(),
                reward_funcs=math_answer_text_reward,
                args=make_args(tmp_path, config_cls=AsyncPPOConfig, num_generations=1, per_device_train_batch_size=4),
                train_dataset=multiplication(num_train=16),
                **kwargs,
            )


def test_tool_timeout_reaches_a_plain_grpo_config_and_is_validated(tmp_path):
    from trl import GRPOConfig

    from trl_async.config import ensure_async_fields

    plain = make_args(tmp_path, config_cls=GRPOConfig)
    assert ensure_async_fields(plain).tool_timeout == 60.0
    assert AsyncGRPOConfig.__dataclass_fields__["tool_timeout"].metadata["help"]
    with pytest.raises(ValueError, match="tool_timeout must be None"):
        make_args(tmp_path, tool_timeout=0)
    assert make_args(tmp_path, tool_timeout=None).tool_timeout is None


# ----------------------------------------------------------------------------------------------- the watchdog
def test_watchdog_reports_a_late_call_by_name_and_beats_while_calls_run():
    late, beats = [], []
    watchdog = CallWatchdog(0.3, late.append, heartbeat=lambda: beats.append(time.monotonic()), poll_s=0.02)
    with watchdog.watching("tool 'quick'"):
        time.sleep(0.1)
    assert late == []
    with watchdog.watching("tool 'search'"):
        time.sleep(0.6)
    assert len(late) == 1 and late[0].startswith("tool 'search' did not return within tool_timeout=0.3s")
    assert len(beats) >= 5  # a running call keeps the generation process's heartbeat going
    unlimited = []
    with CallWatchdog(None, unlimited.append).watching("tool 'slow'"):
        time.sleep(0.05)
    assert unlimited == []


def test_watched_tools_keep_their_schema_and_exceptions():
    import asyncio
    import inspect

    from transformers.utils import get_json_schema

    def multiply(a: int, b: int) -> int:
        raise TypeError("multiply: b must be an integer")

    multiply.__doc__ = MULTIPLY_DOC

    async def lookup(key: str) -> str:
        """
        Look a key up.

        Args:
            key: The key.
        """
        return key.upper()

    timer = CallTimer()
    watchdog = CallWatchdog(5.0, lambda message: None)
    sync_tool, async_tool = (watched(f, f"tool '{f.__name__}'", watchdog, timer) for f in (multiply, lookup))
    assert get_json_schema(sync_tool) == get_json_schema(multiply)
    assert inspect.iscoroutinefunction(async_tool) and not inspect.iscoroutinefunction(sync_tool)
    with pytest.raises(TypeError, match="b must be an integer"):
        sync_tool(a=1, b="2")
    assert asyncio.run(async_tool(key="x")) == "X"
    assert timer.total_s > 0


def test_first_round_calls_run_concurrently_each_rollouts_in_order_with_their_own_errors():
    """The first tool round of a batch, started before TRL's loop: rollouts overlap, one rollout's calls keep TRL's
    order on one thread, and each call's result or exception is what TRL's loop gets when it makes the call."""
    import threading

    from trl_async.rollout.tool_calls import PrefetchedTool, ToolLoopContractError

    log = []

    def search(query: str) -> str:
        log.append((query, threading.get_ident(), time.monotonic()))
        time.sleep(0.3)
        if query == "broken":
            raise ValueError("index offline")
        return query.upper()

    first_round = FirstRoundCalls(threads=4)
    sync_dicts = [{"search": PrefetchedTool(search, row, "search", first_round)} for row in range(4)]

    def turn(*queries):
        calls = [{"type": "function", "function": {"name": "search", "arguments": {"query": q}}} for q in queries]
        return [{"role": "assistant", "content": "", "tool_calls": calls}] if queries else [{"role": "assistant"}]

    completions = [turn("a", "b"), turn("broken"), turn(), turn("c")]
    # A call whose arguments do not unpack fails in TRL's loop before any tool is called: it is not made here either.
    completions[3][0]["tool_calls"].insert(0, {"type": "function", "function": {"name": "search", "arguments": "c"}})
    started = time.monotonic()
    first_round.start(completions, sync_dicts)
    # TRL's loop: row by row, each row's calls in order.
    assert sync_dicts[0]["search"](query="a") == "A" and sync_dicts[0]["search"](query="b") == "B"
    with pytest.raises(ValueError, match="index offline"):
        sync_dicts[1]["search"](query="broken")
    assert sync_dicts[3]["search"](query="c") == "C"
    assert time.monotonic() - started < 0.3 * 4  # four calls one after another would take 1.2 s
    threads = {query: thread for query, thread, _ in log}
    assert threads["a"] == threads["b"] and [q for q, _, _ in log if q in "ab"] == ["a", "b"]
    assert sync_dicts[2]["search"](query="later round") == "LATER ROUND"  # no prefetched call: the call itself
    first_round.start([turn("x"), turn("y")], sync_dicts[:2])
    with pytest.raises(ToolLoopContractError, match="set tool_call_threads=1"):
        sync_dicts[0]["search"](query="not x")
    sequential = FirstRoundCalls(threads=1)
    sequential.start([turn("x"), turn("y")], sync_dicts[:2])
    assert sequential.take(0, "search", {"query": "x"}) is None  # one thread: TRL's loop makes every call


def test_two_ranks_one_calling_tools_and_one_never_stay_in_step(tmp_path):
    """`accelerate launch` with two CPU ranks and the collective check on: rank 0's rows reach an environment with a
    tool and call it, rank 1's reach one without tools and never do. Both train every step, log the same TRL tool
    frequencies (gathered over both ranks), keep identical replicas, and their tools ran in rank 0's generation
    process only."""
    import json
    import subprocess
    import sys

    from tests.support.trainer_utils import free_port

    script = os.path.join(os.path.dirname(__file__), "scripts", "agentic_two_ranks.py")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port())]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_ASYNC_CHECK_COLLECTIVES": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1"}  # fmt: skip
    proc = subprocess.run([*launcher, script, str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [r["steps"] for r in ranks] == [4, 4]
    assert ranks[0]["call_frequency"] == ranks[1]["call_frequency"] and sum(ranks[0]["call_frequency"]) > 0
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=1e-9)
    records = [line.split() for line in (tmp_path / "environment.txt").read_text().splitlines()]
    generator = {k: r["generator_pids"] for k, r in enumerate(ranks)}
    assert all(len(pids) == 1 for pids in generator.values()) and generator[0] != generator[1]
    calls = {int(pid) for kind, _, pid in records if kind == "call"}
    assert calls == set(generator[0])  # only rank 0's generation process ran the tool
    silent = {int(pid) for kind, name, pid in records if kind == "reset" and name == "Silent"}
    assert silent == set(generator[1])
    assert all(pid_is_gone(pid) for pids in generator.values() for pid in pids)
