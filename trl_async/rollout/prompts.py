"""The prompt stream of one rank: which dataset rows each generation batch holds, in TRL's order.

The generation process owns this stream; the trainer trains on whatever the queue delivers, so nothing is replayed
on both sides and nothing has to match. The order is TRL's:

* map-style datasets: `RepeatSampler` (a permutation per epoch drawn from a generator seeded with `seed`, every
  prompt repeated `num_generations` times), cut into global generation batches of `generation_batch_size` rows;
* iterable datasets (`datasets.IterableDataset`, `streaming=True`): TRL's `get_train_dataloader` semantics, a buffered
  `shuffle(seed)` (reshuffled per epoch with `set_epoch`), prompts grouped and repeated as `repeat_iterable_dataset`
  does;
* accelerate's split: each global generation batch is cut into `num_processes` consecutive parts and rank k takes
  part k, as accelerate's batch sharding (map-style) and dispatching (iterable) hand them out.

TRL's dataloader additionally repeats each generation batch `steps_per_generation * num_iterations` times, one copy
per micro-step that reuses it; the generator needs each batch once. The stream never ends: epoch follows epoch.

This module deliberately imports nothing from TRL: importing `trl.trainer` costs the generation process ~4.5 s of
start-up. `repeat_sampler_epochs` reproduces `trl.trainer.utils.RepeatSampler`'s order (a permutation from
`torch.randperm` with a generator seeded once, complete groups only), and `tests/test_prompts.py` checks it against
TRL's class, so a change in TRL fails loudly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def is_iterable_dataset(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")


# What `PromptStream` takes besides the dataset, by name (`GeneratorSpec` carries each under the same name).
STREAM_SETTINGS = ("num_generations", "generation_batch_size", "shuffle", "seed", "process_index", "num_processes",
                   "columns")  # fmt: skip


class PromptStream:
    """Generation batch `index` → that rank's rows (a list of dicts, each with `prompt` and the other columns).

    Access is sequential: `rows(index)` may skip ahead (a resumed run starts at its saved position) but never go back.
    """

    def __init__(
        self,
        dataset: Any,
        num_generations: int,
        generation_batch_size: int,
        shuffle: bool,
        seed: int,
        process_index: int = 0,
        num_processes: int = 1,
        columns: list[str] | None = None,
    ):
        if generation_batch_size % num_generations:
            raise ValueError("generation_batch_size must be divisible by num_generations")
        if generation_batch_size % num_processes:
            raise ValueError("generation_batch_size must be divisible by the number of processes")
        self.dataset = dataset
        self.num_generations = num_generations
        self.generation_batch_size = generation_batch_size
        self.unique_per_batch = generation_batch_size // num_generations
        self.local_size = generation_batch_size // num_processes
        self.process_index = process_index
        self.shuffle = shuffle
        self.seed = seed
        self.columns = columns
        self._batches = self._iterable_batches() if is_iterable_dataset(dataset) else self._map_batches()
        self._next_index = 0

    def rows(self, index: int) -> list[dict]:
        if index < self._next_index:
            raise ValueError(f"the prompt stream is at batch {self._next_index}; it cannot go back to {index}")
        for _ in range(index - self._next_index):
            next(self._batches)  # skipping only draws indices (map-style) or reads the stream (iterable)
        self._next_index = index + 1
        rows = next(self._batches)()
        if self.columns is not None:
            rows = [{k: v for k, v in row.items() if k in self.columns} for row in rows]
        return rows

    def _local(self, global_batch: list) -> list:
        start = self.process_index * self.local_size
        return global_batch[start : start + self.local_size]

    def _map_batches(self) -> Iterator:
        """Yields, per generation batch, a function that reads this rank's rows (reading is deferred, so that
        skipped batches cost no dataset access)."""
        epochs = repeat_sampler_epochs(
            len(self.dataset), self.num_generations, self.unique_per_batch, self.shuffle, self.seed
        )
        for stream in epochs:
            if not stream:
                raise ValueError(
                    f"The dataset has {len(self.dataset)} prompts, fewer than one generation batch needs "
                    f"({self.unique_per_batch} unique prompts)."
                )
            for start in range(0, len(stream), self.generation_batch_size):
                indices = self._local(stream[start : start + self.generation_batch_size])
                yield lambda indices=indices: self._read(indices)

    def _read(self, indices: list[int]) -> list[dict]:
        import datasets

        if isinstance(self.dataset, datasets.Dataset):
            unique = sorted(set(indices))
            columns = self.dataset[unique]  # one batched read
            by_index = {i: {k: v[pos] for k, v in columns.items()} for pos, i in enumerate(unique)}
            return [dict(by_index[i]) for i in indices]
        return [dict(self.dataset[i]) for i in indices]

    def _iterable_batches(self) -> Iterator:
        dataset = self.dataset
        if self.shuffle and hasattr(dataset, "shuffle"):
            dataset = dataset.shuffle(seed=self.seed)
        for epoch in itertools.count():
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            produced = False
            records = iter(dataset)
            while True:
                chunk = list(itertools.islice(records, self.unique_per_batch))
                if len(chunk) < self.unique_per_batch:  # as RepeatSampler, an incomplete last group is dropped
                    break
                produced = True
                global_batch = [dict(record) for record in chunk for _ in range(self.num_generations)]
                rows = self._local(global_batch)
                yield lambda rows=rows: rows
            if not produced:
                raise ValueError(
                    f"The iterable dataset yielded fewer prompts than one generation batch needs "
                    f"({self.unique_per_batch} unique prompts)."
                )


def repeat_sampler_epochs(
    num_samples: int, mini_repeat_count: int, batch_size: int, shuffle: bool, seed: int | None
) -> Iterator[list[int]]:
    """Epoch after epoch, the index order of TRL's `RepeatSampler(range(num_samples), mini_repeat_count, batch_size,
    repeat_count=1, shuffle, seed)` iterated once per epoch: a permutation per epoch from one seeded generator, cut
    into groups of `batch_size` prompts (an incomplete last group is dropped), each index repeated
    `mini_repeat_count` times."""
    generator = None
    if shuffle:
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
    while True:
        order = torch.randperm(num_samples, generator=generator).tolist() if shuffle else list(range(num_samples))
        groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        yield [
            index for group in groups if len(group) == batch_size for index in group for _ in range(mini_repeat_count)
        ]


# ------------------------------------------------------------------------------------------------------- checks
# Prompt values and lengths, checked by the trainer up front (`config.inputs`, on the first rows of a map-style
# dataset) and by the generation process on every batch it draws (an iterable dataset is only seen there).


def context_length(config: Any) -> int | None:
    """The model's context window in tokens, from its (text) config; None if the config does not say."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _prompt_problem(prompt: Any) -> str | None:
    """Why a prompt value cannot be generated from, or None."""
    if isinstance(prompt, str):
        return "is an empty string" if not prompt else None
    if isinstance(prompt, list):
        if not prompt:
            return "is an empty conversation (no messages)"
        for message in prompt:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                return f"has a message {message!r} that is not a dict with 'role' and 'content'"
        return None
    return f"is {prompt!r} ({type(prompt).__name__}), not a string or a list of messages"


def check_prompt_values(prompts: Sequence[Any], first_row: int | None = 0) -> None:
    """Every prompt is a non-empty string or a non-empty conversation (a list of {'role', 'content'} messages).
    `first_row`: the dataset row of the first prompt, or None when unknown (a batch drawn by the generation process)."""
    for offset, prompt in enumerate(prompts):
        problem = _prompt_problem(prompt)
        if problem is not None:
            where = f"train_dataset row {first_row + offset}" if first_row is not None else "A row of this batch"
            raise ValueError(
                f"{where}: its 'prompt' {problem}. Each prompt must be a non-empty "
                "string or a list of {'role': ..., 'content': ...} messages; fix or drop the row (e.g. "
                "`dataset.filter(lambda row: row['prompt'])`)."
            )


def check_prompt_ids(
    prompt_ids: Sequence[Sequence[int]],
    context: int | None,
    first_row: int | None = None,
    prompts: Sequence[Any] | None = None,
) -> None:
    """No prompt is empty once tokenized, and each leaves room for at least one completion token in the model's
    context. `first_row`: the dataset row of the first prompt, when known; else `prompts` (the error quotes it)."""
    for offset, ids in enumerate(prompt_ids):
        if first_row is not None:
            where = f"train_dataset row {first_row + offset}"
        else:
            quoted = repr(prompts[offset])[:80] if prompts is not None else "?"
            where = f"A prompt of this batch ({quoted})"
        if len(ids) == 0:
            raise ValueError(
                f"{where}: its prompt tokenizes to no token at all. Fix or drop the row (e.g. "
                "`dataset.filter(lambda row: row['prompt'])`)."
            )
        if context is not None and len(ids) >= context:
            raise ValueError(
                f"{where}: its prompt has {len(ids)} tokens, but the model's context is {context} tokens "
                f"(max_position_embeddings), which leaves no room for a completion. Shorten or drop the prompts of "
                f"{context} tokens or more (e.g. with `dataset.filter`), or use a model with a longer context."
            )
