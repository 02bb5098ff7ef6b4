"""Tools, environments and rollout functions in the generation process (issue 31; docs/agentic.md).

The generation process runs TRL 1.16's own multi-turn code: `GRPOTrainer._generate` (a `rollout_func`'s dispatch and
its output check, the prompts rendered with their rows' tools by `_tokenize_prompts`, the first turn parsed with
`parse_response`, then `_tool_call_loop`: the calls executed, the tool suffix ids concatenated by
`_get_tool_suffix_ids`, the rows that called a tool sampled again, `tool_mask`, and μ = 0.0 over the tool tokens),
called as functions on `ToolLoopHost`, a small object that provides what they read of a trainer
(`trl_contract.TOOL_LOOP_HOST_ATTRIBUTES`), its sampling backed by the generation backend (μ recorded turn by turn).
Nothing of that code is copied: the ids, masks, truncation, rollback and counts are TRL's.

What is ours, because TRL writes it inline in `_generate_and_score_completions` (which scores and computes log-probs,
so the generation process cannot run it) or has no equivalent there:

* `EnvironmentPool`: one instance per rollout drawn from a pool per environment, reset with its row, the observation
  appended to the prompt's last message, the per-rollout tool dicts (TRL 1.16 `grpo_trainer.py` 2343-2392);
* the calls themselves (`rollout.tool_calls`): `tool_timeout` for every tool call and every environment factory or
  `reset` call, and the first tool round of a batch run concurrently;
* `RolloutContext`: what a `rollout_func` gets instead of the trainer;
* `AgenticRollouts`: one generation batch of an agentic run, from rows to TRL's `_generate` fields.

Importing this module does not import TRL (the generation process imports TRL only for agentic runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..timeline import current as timeline
from ..timeline import names as span
from .prompts import check_prompt_ids, context_length
from .tool_calls import CallTimer, CallWatchdog, FirstRoundCalls, PrefetchedTool, ToolTimeoutError, watched

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of a row an environment's `reset` fills


@dataclasses.dataclass
class AgenticSpec:
    """What the generation process needs to run tools, environments and a rollout function as TRL runs them. Part of
    `GeneratorSpec`, pickled with it in one `cloudpickle.dumps`: an environment class defined in a script travels by
    value, and must unpickle as the same class as the one TRL's `get_reward` reward columns compare with
    (`type(environment) is EnvClass`)."""

    tools: list  # TRL's `_standalone_tools`: the tools not bound to an environment
    environment_factories: dict | None  # TRL's: {name: factory}; {None: factory} for a single factory
    multi_environment: bool  # TRL's `_multi_environment`: each row names its environment in its `environment` column
    rollout_func: Callable | None
    max_tool_calling_iterations: int  # TRL's (sys.maxsize: no limit but max_completion_length)
    max_completion_length: int
    tool_timeout: float | None  # `AsyncGRPOConfig.tool_timeout` (None: no limit)
    tool_call_threads: int = 1  # `AsyncGRPOConfig.tool_call_threads` (1: TRL's one-after-another order)
    args: Any = None  # the trainer's config (`RolloutContext.args`)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of one `generate` call of a batch: the batch's own seed for its first call (so a batch whose
    rows call no tool samples what a plain batch would), a distinct reproducible one for each later call."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/turn/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def named_errors(note: str):
    """An exception raised by the user's code in the block propagates unchanged (its type and message), with a note
    naming the code at fault; the generation process reports the note on the error's first line
    (`generator.error_report`), so the trainer's `GeneratorError` names it."""
    try:
        yield
    except Exception as error:
        with contextlib.suppress(AttributeError, TypeError):
            error.add_note(note)
        raise


def check_environment_names(names, factories: dict) -> None:
    """Each row's `environment` is one of the dict factory's names (TRL's check and message)."""
    for name in dict.fromkeys(names):
        if name not in factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(factories)}."
            )


def _public_methods(instance) -> list:
    """An environment's tools: its public methods but `reset` and `get_reward`, listed on the class so that properties
    are not evaluated (TRL 1.16's rule)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _environment_label(name) -> str:
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


class EnvironmentPool:
    """TRL's environments, built in the generation process: per environment a pool seeded by a probe instance (whose
    methods give the environment's tool schemas), one instance per rollout of a batch, created only when a batch needs
    more at once than exist, reset per rollout, reused across batches ("construct once, reset often")."""

    def __init__(self, factories: dict, multi: bool, standalone_tools: list, watchdog: CallWatchdog, timer: CallTimer):
        self.factories, self.multi = factories, multi
        self.watchdog, self.timer = watchdog, timer
        self.pool: dict[Any, list] = {}
        self.env_tools: dict[Any, list] = {}  # TRL's `_env_tools`: the tools a row of each environment sees
        for name in factories:
            probe = self._create(name)
            self.env_tools[name] = list(standalone_tools) + _public_methods(probe)
            self.pool[name] = [probe]

    def _create(self, name):
        factory = self.factories[name]
        label = f"{_environment_label(name)} ({getattr(factory, '__name__', type(factory).__name__)})"
        with named_errors(f"Raised by {label} in the generation process: an environment that cannot be built ends "
                          "the run."), self.timer.timing(), self.watchdog.watching(label):  # fmt: skip
            return factory()

    def draw(self, names: list) -> list:
        """One instance per rollout, in order (TRL's pool cursor)."""
        handed_out: dict[Any, int] = {}
        environments = []
        for name in names:
            pool, index = self.pool[name], handed_out.get(name, 0)
            if index == len(pool):
                pool.append(self._create(name))
            handed_out[name] = index + 1
            environments.append(pool[index])
        return environments

    def reset(self, environments: list, names: list, rows: list[dict], prompts: list) -> list:
        """Each rollout's environment reset with its row (without the `environment` routing column of the dict form);
        a non-None observation appended to the last message of its prompt, as TRL appends it. Returns the prompts."""
        prompts = list(prompts)
        for i, (environment, name, row) in enumerate(zip(environments, names, rows, strict=True)):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
            what = f"{_environment_label(name).replace('_factory', '')} ({type(environment).__name__}).reset"
            with named_errors(f"Raised by {what} for row {i} of this batch, in the generation process: an environment "
                              "whose reset raises ends the run."), self.timer.timing(), self.watchdog.watching(what):  # fmt: skip
                observation = environment.reset(**kwargs)
            if observation is None:
                continue
            prompt = prompts[i]
            content = prompt[-1]["content"]
            if isinstance(observation, list) and isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if isinstance(observation, str) and isinstance(content, list):
                observation = [{"type": "text", "text": observation}]
            prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]
        return prompts

    def close(self) -> None:
        """Environments with a `close()` are closed when the producer stops (TRL never closes them; clients of remote
        environments hold connections)."""
        for instance in (i for pool in self.pool.values() for i in pool):
            close = getattr(instance, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()


# ------------------------------------------------------------------------------------------------------ TRL's code
class _HostAccelerator:
    """`accelerator` as TRL's `_generate` uses it on one process: its device, and a gather that is the identity."""

    device = "cpu"

    def __init__(self, process_index: int = 0, num_processes: int = 1):
        self.process_index, self.num_processes = process_index, num_processes
        self.is_main_process = process_index == 0

    @staticmethod
    def gather(tensor):
        return tensor


class _RolloutFuncCall:
    """What TRL's `_generate` calls as `self.rollout_func(prompts, self)`: the user's function, given the
    `RolloutContext` instead of the host, its exceptions named."""

    def __init__(self, func: Callable, context: RolloutContext):
        self.func, self.context = func, context

    def __call__(self, prompts, _trainer):
        name = getattr(self.func, "__name__", type(self.func).__name__)
        with named_errors(f"Raised by the rollout_func '{name}' in the generation process: a rollout_func that raises "
                          "ends the run."):  # fmt: skip
            return self.func(prompts, self.context)


class ToolLoopHost:
    """The trainer that TRL 1.16's multi-turn methods (`_generate`, `_tokenize_prompts`, `_tool_call_loop`,
    `_get_tool_suffix_ids`) see outside a trainer: the generation process, and the toy task's evaluation. They run
    here as TRL's own code; this object provides what they read of `self` (`trl_contract.TOOL_LOOP_HOST_ATTRIBUTES`),
    its sampling is `generate_turn(prompt_ids) -> (completion_ids, logprobs or None)`, and an attribute a later TRL
    starts reading fails by name (`__getattr__`).

    `run(prompts)` is TRL's `_generate` (the 8 fields of `trl_contract.GENERATE_FIELDS`). The tool dicts
    (`_sync_tool_dicts`, `_async_tool_dicts`) and, with environments, `_batch_environments` are set per batch."""

    _generate = None  # TRL's functions, bound on first use (importing TRL is slow; the toy imports this module)
    _get_tool_suffix_ids = None

    def __init__(
        self,
        tokenizer,
        generate_turn: Callable,
        *,
        model_config=None,
        tools=(),
        max_completion_length: int = 256,
        max_tool_calling_iterations: int | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        environment_factories: dict | None = None,
        environment_tools: dict | None = None,
        rollout_func: _RolloutFuncCall | None = None,
        first_round: FirstRoundCalls | None = None,
        eos_token_ids=None,
        async_loop=None,
        process_index: int = 0,
        num_processes: int = 1,
    ):
        _bind_trl_methods()
        self._generate_turn = generate_turn
        self.processing_class = self._tokenizer = tokenizer
        self.model = types.SimpleNamespace(config=model_config, training=True)  # `_generate`: mode "train"
        self.tools = list(tools)  # TRL's `self.tools`: every tool of any environment (presence, schemas, parsing)
        self.environment_factories = environment_factories
        self._env_tools = environment_tools or {}
        self._batch_environments: list = []
        self._sync_tool_dicts: list[dict] = []
        self._async_tool_dicts: list[dict] = []
        self.async_loop = async_loop
        self.rollout_func = rollout_func
        self.first_round = first_round  # the first round's sync calls, started before TRL's loop makes them
        self._is_vlm = False
        self.use_vllm, self.vllm_mode, self.vllm_generation, self._last_loaded_step = False, None, None, 0
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs or {})
        self.max_completion_length = max_completion_length
        self.max_tool_calling_iterations = max_tool_calling_iterations or sys.maxsize
        self.num_generations = self.num_generations_eval = 1  # rows arrive repeated; the backend samples one each
        self.eos_token_ids = list(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
        self.accelerator = _HostAccelerator(process_index, num_processes)
        self.state = types.SimpleNamespace(global_step=0, num_input_tokens_seen=0)
        self._metrics = defaultdict(lambda: defaultdict(list))  # what TRL's `_generate` logs; read by no one
        self.tool_call_count = self.tool_failure_count = 0

    def __getattr__(self, name):
        raise AttributeError(
            f"TRL's multi-turn code read trainer.{name}, which trl_async's ToolLoopHost does not provide (written for "
            "TRL 1.16's GRPOTrainer._generate and _tool_call_loop; trl_contract.TOOL_LOOP_HOST_ATTRIBUTES)"
        )

    def run(self, prompts: list) -> tuple:
        """TRL's `_generate(prompts)` on this host: the 8-tuple of `trl_contract.GENERATE_FIELDS`."""
        self.tool_call_count = self.tool_failure_count = 0
        return self._generate(prompts)

    def _tokenize_prompts(self, prompts: list):
        """TRL's, timed as the generation process's `tokenize` span, then the prompts' lengths checked."""
        with timeline().span(span.TOKENIZE):
            prompt_ids, images, multimodal_fields = _trl_tokenize_prompts(self, prompts)
        prompt_ids = [list(ids) for ids in prompt_ids]
        check_prompt_ids(prompt_ids, context_length(self.model.config), prompts=prompts)
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's sampling call: one completion per row of `prompt_ids`, and its log-probs (or None)."""
        return self._generate_turn([list(ids) for ids in prompt_ids])

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's, with its call and failure totals kept (`_generate` only logs them as frequencies)."""
        from ..trl_contract import tool_loop_fields

        if self.first_round is not None and self.max_tool_calling_iterations > 0:
            self.first_round.start(completions, self._sync_tool_dicts)
        try:
            result = _trl_tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                         multimodal_fields)  # fmt: skip
        finally:
            if self.first_round is not None:
                self.first_round.finish()
        fields = tool_loop_fields(result)
        self.tool_call_count, self.tool_failure_count = fields["tool_call_count"], fields["tool_failure_count"]
        return result


_trl_tokenize_prompts = _trl_tool_call_loop = None


def _bind_trl_methods() -> None:
    global _trl_tokenize_prompts, _trl_tool_call_loop
    if ToolLoopHost._generate is None:
        from trl import GRPOTrainer

        ToolLoopHost._generate = GRPOTrainer._generate
        ToolLoopHost._get_tool_suffix_ids = GRPOTrainer._get_tool_suffix_ids
        _trl_tokenize_prompts = GRPOTrainer._tokenize_prompts
        _trl_tool_call_loop = GRPOTrainer._tool_call_loop


class RolloutContext:
    """What a `rollout_func` gets in the generation process, where TRL passes the trainer (`rollout_func(prompts,
    trainer)`): TRL's attribute names for what exists there, and `generate`. Any other attribute fails, saying so."""

    def __init__(self, *, processing_class, args, state, num_generations, max_completion_length, temperature,
                 generation_config, chat_template, chat_template_kwargs, process_index, num_processes,
                 generate_turn):  # fmt: skip
        self.processing_class = processing_class
        self.args = args
        self._state = state  # () -> the trainer's state at the weights' version (or None before the first publish)
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.generation_config = generation_config
        self.chat_template, self.chat_template_kwargs = chat_template, chat_template_kwargs
        self.accelerator = _HostAccelerator(process_index, num_processes)
        self._generate_turn = generate_turn

    @property
    def state(self):
        return self._state()

    def generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per row of `prompt_ids` (token ids), sampled with the generation process's weights (this
        batch's version) and TRL's sampling settings: the completion ids, cut after the first EOS, and μ, the log-prob
        of each sampled token (return it as `logprobs`)."""
        return self._generate_turn([list(ids) for ids in prompt_ids])

    def __getattr__(self, name):
        raise AttributeError(
            f"rollout_func read trainer.{name}, which the generation process does not have. With async_generation="
            "True a rollout_func gets a RolloutContext: processing_class, args, state, num_generations, "
            "max_completion_length, temperature, generation_config, chat_template, chat_template_kwargs, "
            "accelerator.process_index, generate(prompt_ids). Set async_generation=False to get the trainer itself."
        )


# ------------------------------------------------------------------------------------------------------ one batch
@dataclasses.dataclass
class MultiTurnBatch:
    """One agentic generation batch, as TRL's `_generate` returned it, with what the rewards need besides."""

    rows: list[dict]  # the batch's rows, each with its prompt as generated (a reset's observation appended) and a
    # rollout_func's extra fields merged in, as TRL merges them into `inputs` before scoring
    prompts: list  # the prompts as generated
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # the whole multi-turn completion: model turns and tool tokens
    logprobs: list[list[float]]  # μ of the model's tokens, 0.0 at tool tokens (TRL's placeholder)
    tool_mask: list[list[int]]  # 1 model token, 0 tool or environment token (all ones where no tool ran)
    completions: list  # TRL's parsed messages (or texts)
    tool_call_count: int
    tool_failure_count: int
    extra_fields: dict
    environments: list | None  # the rollouts' environment instances (reward functions get them as `environments=`)
    tool_s: float


class AgenticRollouts:
    """The generation batches of a run with tools, environments or a `rollout_func`, made by TRL's own `_generate` on
    a `ToolLoopHost` (`RolloutProducer` delegates here). `generate(prompt_ids, seed)` is the backend's sampling."""

    def __init__(self, spec, generate: Callable, trainer_state: Callable, heartbeat=None, on_late=None):
        agentic: AgenticSpec = spec.agentic
        self.spec, self.agentic = spec, agentic
        self._generate, self._seed, self._turn = generate, 0, 0
        self.watchdog = CallWatchdog(agentic.tool_timeout, on_late, heartbeat)
        self.timer = CallTimer()
        factories = agentic.environment_factories
        self.pool = None
        if factories is not None:
            self.pool = EnvironmentPool(factories, agentic.multi_environment, agentic.tools, self.watchdog, self.timer)
        tools = list(agentic.tools)
        for env_tools in self.pool.env_tools.values() if self.pool else ():
            tools += [t for t in env_tools if t not in tools]  # TRL's union (`self.tools`)
        self._loop_thread = self._loop = None
        if any(_is_async_callable(t) for t in tools):
            from trl.trainer.utils import start_event_loop_in_daemon

            self._loop_thread, self._loop, ready = start_event_loop_in_daemon(name="trl-async-tool-loop")
            ready.wait()
        rollout_func = None
        if agentic.rollout_func is not None:
            context = RolloutContext(
                processing_class=spec.processing_class, args=agentic.args, state=trainer_state,
                num_generations=spec.num_generations, max_completion_length=agentic.max_completion_length,
                temperature=spec.temperature, generation_config=spec.generation_config,
                chat_template=spec.chat_template, chat_template_kwargs=spec.chat_template_kwargs,
                process_index=spec.process_index, num_processes=spec.num_processes, generate_turn=self._sample_turn,
            )  # fmt: skip
            rollout_func = _RolloutFuncCall(agentic.rollout_func, context)
        self.first_round = FirstRoundCalls(agentic.tool_call_threads)
        self.host = ToolLoopHost(
            spec.processing_class,
            self._sample_turn,
            model_config=spec.model_spec.config,
            tools=tools,
            max_completion_length=agentic.max_completion_length,
            max_tool_calling_iterations=agentic.max_tool_calling_iterations,
            chat_template=spec.chat_template,
            chat_template_kwargs=spec.chat_template_kwargs,
            environment_factories=factories,
            environment_tools=self.pool.env_tools if self.pool else None,
            rollout_func=rollout_func,
            first_round=self.first_round,
            eos_token_ids=spec.eos_token_ids,
            async_loop=self._loop,
            process_index=spec.process_index,
            num_processes=spec.num_processes,
        )

    def _sample_turn(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        output = self._generate(prompt_ids, turn_seed(self._seed, self._turn))
        self._turn += 1
        return output.to_lists()

    def _tool_dicts(self, environments: list | None, num_rows: int) -> tuple[list[dict], list[dict]]:
        """Per rollout, its tools by name (the standalone ones, and its own environment instance's methods), split
        into sync and async as TRL splits them, each timed and bounded by `tool_timeout`; the sync ones served by the
        first round's concurrent calls (`FirstRoundCalls`)."""
        sync_dicts, async_dicts = [], []
        for i in range(num_rows):
            environment = environments[i] if environments else None
            owner = "" if environment is None else f" of environment {type(environment).__name__}"
            sync_dict, async_dict = {}, {}
            for tool in list(self.agentic.tools) + (_public_methods(environment) if environment is not None else []):
                wrapped = watched(tool, f"tool '{tool.__name__}'{owner}", self.watchdog, self.timer)
                if inspect.iscoroutinefunction(tool):
                    async_dict[tool.__name__] = wrapped
                else:
                    sync_dict[tool.__name__] = PrefetchedTool(wrapped, i, tool.__name__, self.first_round)
            sync_dicts.append(sync_dict)
            async_dicts.append(async_dict)
        return sync_dicts, async_dicts

    def sample(self, rows: list[dict], seed: int) -> MultiTurnBatch:
        """One batch: environments drawn and reset, TRL's `_generate` (every turn, every tool call) on the host."""
        from ..trl_contract import generate_fields

        self._seed, self._turn = seed, 0
        self.timer.total_s = 0.0
        rows = [dict(row) for row in rows]
        host = self.host
        environments = None
        if self.pool is not None:
            names = [row.get("environment") if self.agentic.multi_environment else None for row in rows]
            if self.agentic.multi_environment:
                check_environment_names(names, self.pool.factories)
            environments = self.pool.draw(names)
            prompts = self.pool.reset(environments, names, rows, [row.get("prompt", EMPTY_PROMPT) for row in rows])
            host._batch_environments = names
        else:
            prompts = [row["prompt"] for row in rows]
        if host.tools:
            host._sync_tool_dicts, host._async_tool_dicts = self._tool_dicts(environments, len(rows))
        fields = generate_fields(host.run(prompts))
        completion_ids, logprobs = fields["completion_ids"], fields["logprobs"]
        tool_mask = fields["tool_mask"] or [[1] * len(ids) for ids in completion_ids]
        self._check_lengths(rows, fields, tool_mask)
        extra_fields = fields["extra_fields"]
        for i, row in enumerate(rows):  # TRL's merge into `inputs`, before its `_calculate_rewards`
            row["prompt"] = prompts[i]
            for key, values in extra_fields.items():
                if isinstance(values, list) and i < len(values):
                    row[key] = values[i]
                elif not isinstance(values, list):
                    row[key] = values
        return MultiTurnBatch(
            rows=rows,
            prompts=prompts,
            prompt_ids=[list(ids) for ids in fields["prompt_ids"]],
            completion_ids=[list(ids) for ids in completion_ids],
            logprobs=[[float(x) for x in row] for row in logprobs],
            tool_mask=[list(mask) for mask in tool_mask],
            completions=fields["completions"],
            tool_call_count=int(host.tool_call_count),
            tool_failure_count=int(host.tool_failure_count),
            extra_fields=dict(extra_fields),
            environments=environments,
            tool_s=self.timer.total_s,
        )

    def _check_lengths(self, rows: list[dict], fields: dict, tool_mask: list) -> None:
        """A `rollout_func`'s output has one entry per row and one log-prob (and mask value) per completion token:
        the trainer pads and masks by these lengths (TRL checks only the keys)."""
        source = "rollout_func" if self.agentic.rollout_func is not None else "the generation process"
        if fields["logprobs"] is None:
            raise ValueError(
                f"{source} returned logprobs=None: asynchronous training corrects each row against the log-probs of the "
                "distribution that sampled it (μ). Return them (RolloutContext.generate gives them), or set "
                "async_generation=False."
            )
        for name in ("prompt_ids", "completion_ids", "logprobs"):
            if len(fields[name]) != len(rows):
                raise ValueError(f"{source} returned {len(fields[name])} {name} for a batch of {len(rows)} rows.")
        for i, ids in enumerate(fields["completion_ids"]):
            for name, values in (("logprobs", fields["logprobs"][i]), ("env_mask", tool_mask[i])):
                if len(values) != len(ids):
                    raise ValueError(
                        f"{source} returned {len(values)} {name} values for the {len(ids)} completion tokens of row {i}."
                    )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.first_round._executor is not None:
            self.first_round._executor.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            from trl.trainer.utils import shutdown_event_loop_in_daemon

            with contextlib.suppress(Exception):
                shutdown_event_loop_in_daemon(self._loop_thread, self._loop)


def _is_async_callable(func) -> bool:
    """TRL's `is_async_callable` (partials unwrapped; a callable object's `__call__`), without importing TRL."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or (callable(func) and inspect.iscoroutinefunction(func.__call__))


__all__ = [
    "AgenticRollouts",
    "AgenticSpec",
    "CallWatchdog",
    "EnvironmentPool",
    "FirstRoundCalls",
    "MultiTurnBatch",
    "RolloutContext",
    "ToolLoopHost",
    "ToolTimeoutError",
    "check_environment_names",
    "turn_seed",
]
