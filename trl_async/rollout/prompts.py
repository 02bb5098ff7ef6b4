"""The order in which a rank's generator takes prompts: exactly the order that rank's trainer will ask for them.

TRL feeds each rank a *generation batch* from a `RepeatSampler`: the sampler yields the global generation batch
(`generation_batch_size` indices: unique prompts, each repeated `num_generations` times), repeated once per micro-step
that reuses it; accelerate splits that stream into per-rank batches of `generation_batch_size / num_processes`,
giving batch k of the stream to rank k mod num_processes. The trainer generates only on the first micro-step of
each repeat. Replaying the same sampler with the same seed here means the rows a generator produces are the rows
its trainer's dataloader will hand over; the trainer checks that the prompts match, so any drift fails loudly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from trl.trainer.utils import RepeatSampler


def local_generation_batches(
    num_prompts: int,
    num_generations: int,
    generation_batch_size: int,
    repeat_count: int,
    shuffle: bool,
    seed: int,
    process_index: int,
    num_processes: int,
) -> Iterator[list[int]]:
    """Yield, forever (epoch after epoch), the dataset indices of this rank's successive generation batches."""
    if generation_batch_size % num_processes:
        raise ValueError("generation_batch_size must be divisible by num_processes")
    local = generation_batch_size // num_processes
    sampler = RepeatSampler(
        data_source=range(num_prompts),
        mini_repeat_count=num_generations,
        batch_size=generation_batch_size // num_generations,
        repeat_count=repeat_count,
        shuffle=shuffle,
        seed=seed,
    )
    for _ in itertools.count():
        stream = list(sampler)  # one epoch; each call draws the next permutation, as the trainer's dataloader does
        if not stream:
            raise ValueError(
                f"The dataset has {num_prompts} prompts, fewer than one generation batch needs "
                f"({generation_batch_size // num_generations} unique prompts)."
            )
        block = generation_batch_size * repeat_count
        for start in range(0, len(stream), block):
            yield stream[start + process_index * local : start + (process_index + 1) * local]
