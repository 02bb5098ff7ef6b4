"""One generation batch, from the prompt stream to the payload: `RolloutProducer`, and the `GeneratorSpec` it is built
from.

`RolloutProducer` takes a batch's rows from the prompt stream, tokenizes the prompts as TRL does, samples completions
with behaviour log-probs (single turn, or TRL's multi-turn loop with tools, environments or a `rollout_func`:
`rollout.agentic`), scores them with the reward callables (tensor-native ones on the ids, without decoding; text ones
after one decode) and returns the payload the trainer consumes. The generation process runs it in a loop
(`rollout.generator`); the trainer runs the very same code on its own model for the first batches of a run, while the
generation process is still starting (`rollout.pipeline`), except in agentic runs, whose tools and environments run in
the generation process only (docs/agentic.md).

A batch is seeded from (`seed`, its process index, its position in the stream), as TRL seeds ranks: a batch is a
function of the weights, the prompts and that seed, wherever it is generated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import defaultdict
from typing import Any

import torch

from ..timeline import current as timeline
from ..timeline import names as span
from ..timeline.setup import TimelineSpec
from .agentic import AgenticSpec
from .backends import GenerationOutput, ModelSpec, SeededPrompts
from .payload import RolloutPayload
from .prompts import STREAM_SETTINGS, PromptStream, check_prompt_ids, check_prompt_values, context_length


def batch_seed(seed: int, process_index: int, stream_index: int) -> int:
    """The sampling seed of one generation batch: distinct per rank and per batch, reproducible from `seed`."""
    digest = hashlib.blake2b(f"{seed}/{process_index}/{stream_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass
class GeneratorSpec:
    """Everything a producer needs besides the model and the shared-memory objects. Serialized with cloudpickle, so
    reward functions defined in the user's script travel by value, whether it runs as `__main__` or, in a spawned
    worker, as `__mp_main__` (`_script_pickled_by_value`)."""

    process_index: int
    num_processes: int
    device: str
    num_threads: int
    backend: str
    model_spec: ModelSpec
    generation_config: Any
    temperature: float
    eos_token_ids: list[int]
    pad_token_id: int
    processing_class: Any
    chat_template: str | None
    chat_template_kwargs: dict
    dataset: Any
    num_generations: int
    generation_batch_size: int
    shuffle: bool
    seed: int
    reward_funcs: list  # reward callables; `None` where the trainer scores the function (reward models)
    reward_func_names: list[str]
    decode: bool  # decode even when no text reward needs it (completion logging, reward models)
    parent_pid: int
    stream_offset: int = 0  # position of queue item 0 in the prompt stream (a resumed run starts later)
    inflight_weight_updates: bool = False  # load newer weights between decoding steps (`_produce_inflight`)
    timeline: TimelineSpec | None = None  # where this process records its timeline (None: `timeline=False`)
    columns: list[str] | None = None  # dataset columns to keep (None: all)
    backend_options: dict = dataclasses.field(default_factory=dict)
    agentic: AgenticSpec | None = None  # tools, environments, rollout_func (`rollout.agentic`); None without them
    # Generation batches decoded in one backend call (`config.grpo.items_per_decode`): the generation process reserves
    # that many from the queue at once (`StalenessBoundedQueue.reserve_block`).
    items_per_decode: int = 1


def is_conversational_prompt(prompt) -> bool:
    """`trl.data_utils.is_conversational({"prompt": prompt})` (a list of messages with roles), without importing TRL
    in the generation process; `tests/test_prompts.py` checks that both agree."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class RolloutProducer:
    """Makes generation batches: prompts from the stream → completions, μ, rewards (the child and the trainer).

    With tools, environments or a `rollout_func` (`spec.agentic`) the completions are TRL's multi-turn ones
    (`rollout.agentic`); `heartbeat` and `on_late` are the generation process's (`tool_timeout`, `CallWatchdog`)."""

    def __init__(self, spec: GeneratorSpec, generate_batches, trainer_state=None, heartbeat=None, on_late=None):
        self.spec = spec
        # ([SeededPrompts], ready=None) -> [GenerationOutput]: the rows of one or several generation batches, each
        # sampled from its own seed (`GenerationBackend.generate_batches`).
        self.generate_batches = generate_batches
        self.tokenizer = spec.processing_class
        self.trainer_state = trainer_state  # () -> TrainerState snapshot or None
        self.stream = PromptStream(spec.dataset, **{name: getattr(spec, name) for name in STREAM_SETTINGS})
        self.agentic = None
        if spec.agentic is not None:
            from .agentic import AgenticRollouts

            self.agentic = AgenticRollouts(
                spec, self._generate_one, trainer_state or (lambda: None), heartbeat, on_late
            )

    def _generate_one(self, prompt_ids: list[list[int]], seed: int | None) -> GenerationOutput:
        """One batch's rows (TRL's multi-turn loop samples one batch's turns at a time)."""
        return self.generate_batches([SeededPrompts(prompt_ids, seed)])[0]

    def close(self) -> None:
        """Release what the producer holds (environments with a `close()`, the event loop of async tools)."""
        if self.agentic is not None:
            self.agentic.close()

    def _tokenize(self, prompts: list) -> list[list[int]]:
        # TRL's `GRPOTrainer._tokenize_prompts`, text-only path without tools (agentic runs use TRL's own method).
        if is_conversational_prompt(prompts[0]):
            return list(
                self.tokenizer.apply_chat_template(
                    conversation=prompts,
                    chat_template=self.spec.chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **self.spec.chat_template_kwargs,
                )["input_ids"]
            )
        return list(self.tokenizer(text=prompts)["input_ids"])

    def _decode(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], conversational: bool) -> list:
        # TRL's `GRPOTrainer._generate` decoding: `parse_response` where the tokenizer defines a response format.
        if conversational:
            if getattr(self.tokenizer, "response_template", None) is not None or (
                getattr(self.tokenizer, "response_schema", None) is not None
            ):
                from trl.chat_template_utils import parse_response

                return [
                    [parse_response(self.tokenizer, ids, prefix=prompt_ids[i], tools=None)]
                    for i, ids in enumerate(completion_ids)
                ]
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            return [[{"role": "assistant", "content": text}] for text in texts]
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def prepare_rewards_for_dataset(self, max_rows: int = 50_000) -> None:
        """Prepare the tensor-native rewards' tokenizer-dependent tables (gold answers' token spellings) for the whole
        dataset at start-up, so that no tokenizer runs at reward time; datasets that are large or iterable are
        prepared batch by batch instead (see `produce`)."""
        import datasets

        from trl_async.rewards import prepare_rewards

        dataset = self.spec.dataset
        if isinstance(dataset, datasets.Dataset) and len(dataset) <= max_rows:
            names = [c for c in dataset.column_names if c not in ("prompt", "completion", "completion_ids")]
            if names:
                prepare_rewards([f for f in self.spec.reward_funcs if f is not None], {c: dataset[c] for c in names})

    def _sample_block(self, batches: list[tuple[list[dict], int]], ready) -> list[_Sampled]:
        """One completion per row of each `(rows, seed)` batch, single turn: the prompts tokenized as TRL does,
        sampled with μ recorded, all batches in one decode where the backend can (`generate_batches`), each from its
        own seed. `ready()`, if given, runs once they are laid out, before the model first runs on them."""
        from trl_async.rewards import prepare_rewards

        spec = self.spec
        recorder = timeline()
        laid_out = []
        for rows, seed in batches:
            prompts = [row["prompt"] for row in rows]
            check_prompt_values(prompts, first_row=None)
            prepared = recorder.begin()
            # Gold answers not prepared at start-up are prepared now, before sampling: the tokenizer never runs at
            # reward time (a no-op for rows already prepared).
            prepare_rewards([f for f in spec.reward_funcs if f is not None], _reward_columns(rows))
            prompt_ids = [list(p) for p in self._tokenize(prompts)]
            check_prompt_ids(prompt_ids, context_length(spec.model_spec.config), prompts=prompts)
            recorder.end(span.TOKENIZE, prepared)
            laid_out.append((rows, prompts, prompt_ids, seed))
        outputs = self.generate_batches([SeededPrompts(ids, seed) for _, _, ids, seed in laid_out], ready)
        return [self._sampled(rows, prompts, prompt_ids, generated) for (rows, prompts, prompt_ids, _), generated in
                zip(laid_out, outputs, strict=True)]  # fmt: skip

    def _sampled(self, rows, prompts, prompt_ids, generated: GenerationOutput) -> _Sampled:
        completion_ids, logprobs = generated.to_lists()
        conversational = is_conversational_prompt(prompts[0])
        return _Sampled(
            rows=rows,
            prompts=prompts,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            padded_ids=generated.completion_ids,
            padded_mask=generated.completion_mask,
            decode=_DecodeOnce(lambda: self._decode(prompt_ids, completion_ids, conversational)),
            token_versions=generated.token_version_lists(),
        )

    def _sample_multi_turn(self, rows: list[dict], seed: int) -> _Sampled:
        """Tools, environments or a `rollout_func`: TRL's multi-turn `_generate` (`rollout.agentic`). Tensor rewards
        see the whole completion, tool tokens included, as TRL's reward functions see `completion_ids`."""
        from trl_async.rewards import prepare_rewards

        turns = self.agentic.sample(rows, seed)
        prepare_rewards([f for f in self.spec.reward_funcs if f is not None], _reward_columns(turns.rows))
        padded_ids, padded_mask = _padded(turns.completion_ids, self.spec.pad_token_id)
        return _Sampled(
            rows=turns.rows,
            prompts=turns.prompts,
            prompt_ids=turns.prompt_ids,
            completion_ids=turns.completion_ids,
            logprobs=turns.logprobs,
            padded_ids=padded_ids,
            padded_mask=padded_mask,
            decode=_DecodeOnce(lambda: turns.completions),
            token_versions=None,  # one version per batch: weights change only between batches (no in-flight updates)
            turns=turns,
        )

    def produce(self, queue_index: int, ready=None) -> RolloutPayload:
        """The payload of queue item `queue_index` (stream position `stream_offset + queue_index`). `ready()`, if
        given, runs once the batch is prepared, before its first token is sampled (`GenerationBackend.generate`)."""
        return self.produce_block(queue_index, 1, ready)[0]

    def produce_block(self, first_index: int, count: int, ready=None) -> list[RolloutPayload]:
        """The payloads of queue items `first_index .. first_index + count - 1`, sampled in one decode (single-turn
        runs; an agentic run samples one batch at a time). Each batch keeps its own rows and seed (its stream
        position's), so each is what `produce` makes of it alone; its `generate_s` is its share of the decode, by rows."""
        spec = self.spec
        positions = [spec.stream_offset + index for index in range(first_index, first_index + count)]
        batches = [(self.stream.rows(p), batch_seed(spec.seed, spec.process_index, p)) for p in positions]
        t0 = time.perf_counter()
        if self.agentic is None:
            block = self._sample_block(batches, ready)
        else:
            if count != 1:
                raise ValueError("an agentic run samples one generation batch at a time (items_per_decode=1)")
            block = [self._sample_multi_turn(*batches[0])]
        sampling_s = time.perf_counter() - t0
        decode_rows = sum(len(sampled.rows) for sampled in block)
        return [
            self._score(sampled, position, sampling_s * len(sampled.rows) / decode_rows, decode_rows)
            for sampled, position in zip(block, positions, strict=True)
        ]

    def _score(self, sampled: _Sampled, stream_index: int, sampling_s: float, decode_rows: int) -> RolloutPayload:
        """Rewards (tensor-native ones on the ids, text ones after one decode) and the payload of one batch."""
        from trl_async.rewards import score_completions

        spec = self.spec
        turns = sampled.turns
        t1 = time.perf_counter()
        recorder = timeline()
        scoring = recorder.begin()
        extra_logs: dict[str, list] = defaultdict(list)
        logged_metrics: dict[str, list] = defaultdict(list)
        rewards = torch.full((len(sampled.rows), len(spec.reward_funcs)), float("nan"))
        callables = [f for f in spec.reward_funcs if f is not None]
        if callables:
            extra_kwargs = {
                "trainer_state": self.trainer_state() if self.trainer_state is not None else None,
                "log_extra": lambda column, values: extra_logs[column].extend(values),
                "log_metric": lambda name, value: logged_metrics[name].append(value),
            }
            if turns is not None and turns.environments is not None:
                extra_kwargs["environments"] = turns.environments  # as TRL's `_calculate_rewards` passes them
            scored = score_completions(
                callables,
                sampled.padded_ids,
                sampled.padded_mask,
                _reward_columns(sampled.rows),
                prompts=sampled.prompts,
                decode=sampled.decode,
                reward_func_names=[n for f, n in zip(spec.reward_funcs, spec.reward_func_names, strict=True) if f],
                extra_kwargs=extra_kwargs,
            ).cpu()
            positions = [i for i, f in enumerate(spec.reward_funcs) if f is not None]
            rewards[:, positions] = scored
        if spec.decode:
            sampled.decode()
        t2 = time.perf_counter()
        recorder.end(span.REWARDS, scoring)
        tool_s = turns.tool_s if turns is not None else 0.0
        return RolloutPayload(
            rows=sampled.rows,
            stream_index=stream_index,
            prompt_ids=sampled.prompt_ids,
            completion_ids=sampled.completion_ids,
            logprobs=sampled.logprobs,
            rewards_per_func=rewards,
            completions=sampled.decode.result,
            extra_logs=dict(extra_logs),
            logged_metrics=dict(logged_metrics),
            generate_s=sampling_s - tool_s,
            reward_s=t2 - t1,
            token_versions=sampled.token_versions,
            tool_mask=turns.tool_mask if turns is not None else None,
            tool_call_count=turns.tool_call_count if turns is not None else 0,
            tool_failure_count=turns.tool_failure_count if turns is not None else 0,
            extra_fields=turns.extra_fields if turns is not None else {},
            tool_s=tool_s,
            decode_rows=decode_rows,
        )

    def sample_prompt_ids(self) -> list[list[int]]:
        """The first batch's tokenized prompts: the shapes a backend warms up on (`GenerationBackend.warm_up`)."""
        if self.agentic is not None:
            return []
        rows = self.stream.rows(self.spec.stream_offset)
        return [list(p) for p in self._tokenize([row["prompt"] for row in rows])]


@dataclasses.dataclass
class _Sampled:
    """A batch's rows, sampled, before scoring (either path of `RolloutProducer.produce`)."""

    rows: list[dict]
    prompts: list
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    padded_ids: torch.Tensor  # (B, L) what tensor rewards read, with `padded_mask`
    padded_mask: torch.Tensor
    decode: _DecodeOnce
    token_versions: list[list[int]] | None
    turns: Any = None  # `agentic.MultiTurnBatch` of an agentic run, else None


def _reward_columns(rows: list[dict]) -> dict[str, list]:
    """The columns TRL passes reward functions as keyword arguments: every key of the rows but the prompt and
    completion ones."""
    return {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}


def _padded(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists as TRL pads completions: (B, L) right-padded ids and a mask of ones over each sequence."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = True
    return ids, mask


class _DecodeOnce:
    """Decodes a batch on first call only; text rewards share the result, tensor rewards never trigger it."""

    def __init__(self, decode):
        self._decode, self.result = decode, None

    def __call__(self):
        if self.result is None:
            self.result = self._decode()
        return self.result
