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
from collections.abc import Iterator
from typing import Any

import torch


def is_iterable_dataset(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")


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
