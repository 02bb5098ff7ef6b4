"""The prompt stream of a generation process equals, batch for batch, what TRL's own training dataloader hands a rank.

The references are TRL's real objects, never a re-derivation of our own: `trl.trainer.utils.RepeatSampler`, the
dataloader of a real `GRPOTrainer` (`get_train_dataloader()`, accelerate-prepared, under a real two-process
`accelerate launch` for the per-rank split), and TRL's iterable pipeline (`shuffle(seed)` + `repeat_iterable_dataset`).
TRL's dataloader yields every generation batch `num_iterations * steps_per_generation` times in a row; the stream
yields it once, so the references keep the first copy of each run (and check that the skipped copies are repeats).

Run as a script (`accelerate launch ... tests/test_prompts.py OUT_DIR`), this file records each rank's TRL batches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from trl_async.rollout.generator import is_conversational_prompt
from trl_async.rollout.prompts import PromptStream, repeat_sampler_epochs

NUM_EPOCHS = 3

# GRPOConfig variations whose dataloaders are compared with the stream. Each is valid for one and for two processes.
TRAINER_VARIATIONS = {
    "default": dict(per_device_train_batch_size=4, num_generations=2),
    "steps_per_generation": dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2),
    "num_iterations": dict(per_device_train_batch_size=3, num_generations=3, steps_per_generation=2, num_iterations=2),
    "seed": dict(per_device_train_batch_size=4, num_generations=4, seed=1234),
    "no_shuffle": dict(per_device_train_batch_size=4, num_generations=2, shuffle_dataset=False),
    "remove_unused_columns": dict(per_device_train_batch_size=4, num_generations=2, remove_unused_columns=True),
}
# Only valid with two processes: a group of 4 completions spread over 2 ranks of 2 rows.
TWO_RANK_VARIATIONS = {
    "group_across_ranks": dict(per_device_train_batch_size=2, num_generations=4),
}


def make_dataset(num_rows: int = 23) -> Dataset:
    """Conversational prompts (as TRL's GRPO datasets) plus extra columns; `num_rows` not a multiple of any group."""
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(num_rows)],
            "answer": [str(i * 7) for i in range(num_rows)],
            "row_id": list(range(num_rows)),
        }
    )


def build_grpo_trainer(output_dir: str, dataset, **overrides):
    """A real TRL `GRPOTrainer` on the bundled tiny model (nothing trains: only its dataloader is read)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_async.toy import tiny_model_path

    kwargs = dict(output_dir=output_dir, report_to="none", max_steps=1000, use_cpu=True, seed=0, bf16=False)
    kwargs.update(overrides)
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=GRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path()),
    )


def trl_generation_batches(trainer, num_epochs: int = NUM_EPOCHS, max_batches: int | None = None) -> list[list]:
    """This rank's generation batches from TRL's training dataloader, iterated epoch after epoch as `Trainer` does
    (`set_epoch` before each epoch), keeping one copy of each run of repeats."""
    repeats = trainer.num_iterations * trainer.args.steps_per_generation
    dataloader = trainer.get_train_dataloader()
    batches = []
    for epoch in range(num_epochs):
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        loaded = [list(batch) for batch in dataloader]
        assert loaded and len(loaded) % repeats == 0, (len(loaded), repeats)
        for start in range(0, len(loaded), repeats):
            run = loaded[start : start + repeats]
            assert all(copy == run[0] for copy in run), "TRL's repeats of a generation batch differ"
            batches.append(run[0])
        if max_batches is not None and len(batches) >= max_batches:
            return batches[:max_batches]
    return batches


def trainer_record(trainer) -> dict:
    """What the stream needs to know about a trainer, plus TRL's batches of this rank."""
    columns = None
    if trainer.args.remove_unused_columns:
        trainer._set_signature_columns_if_needed()
        columns = list(trainer._signature_columns)
    return {
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "num_generations": trainer.num_generations,
        "generation_batch_size": trainer.args.generation_batch_size,
        "shuffle": trainer.shuffle_dataset,
        "seed": trainer.args.seed,
        "columns": columns,
        "batches": trl_generation_batches(trainer),
    }


def stream_batches(record: dict, dataset, num_batches: int) -> list[list]:
    stream = PromptStream(
        dataset,
        num_generations=record["num_generations"],
        generation_batch_size=record["generation_batch_size"],
        shuffle=record["shuffle"],
        seed=record["seed"],
        process_index=record["process_index"],
        num_processes=record["num_processes"],
        columns=record["columns"],
    )
    return [stream.rows(i) for i in range(num_batches)]


# ------------------------------------------------------------------------------------------ RepeatSampler order
@pytest.mark.parametrize("shuffle,seed", [(True, 0), (True, 42), (False, 0)])
@pytest.mark.parametrize(
    "num_samples,mini_repeat_count,batch_size",
    [(7, 2, 3), (12, 4, 4), (13, 1, 5), (5, 3, 1), (9, 2, 9), (3, 2, 4)],
)
def test_repeat_sampler_epochs_equal_trl_repeat_sampler(num_samples, mini_repeat_count, batch_size, shuffle, seed):
    from trl.trainer.utils import RepeatSampler

    sampler = RepeatSampler(
        range(num_samples), mini_repeat_count, batch_size=batch_size, repeat_count=1, shuffle=shuffle, seed=seed
    )
    epochs = repeat_sampler_epochs(num_samples, mini_repeat_count, batch_size, shuffle, seed)
    for _ in range(4):  # the same sampler object iterated again draws the next epoch's permutation
        assert next(epochs) == list(sampler)


def test_repeat_sampler_epochs_shuffle_differs_between_epochs_and_drops_incomplete_group():
    # The comparison above can only fail usefully if epochs really differ and the last group really is dropped.
    epochs = repeat_sampler_epochs(10, 2, 3, shuffle=True, seed=0)
    first, second = next(epochs), next(epochs)
    assert first != second
    assert len(first) == len(second) == 3 * 3 * 2  # 10 prompts: 3 complete groups of 3, each prompt twice
    assert all(first[i] == first[i + 1] for i in range(0, len(first), 2))


# ------------------------------------------------------------------------------------------ map-style, one process
@pytest.fixture(scope="module")
def dataset():
    return make_dataset()


@pytest.mark.parametrize("variation", list(TRAINER_VARIATIONS))
def test_map_style_stream_equals_trl_train_dataloader(tmp_path, dataset, variation):
    trainer = build_grpo_trainer(str(tmp_path), dataset, **TRAINER_VARIATIONS[variation])
    record = trainer_record(trainer)
    expected = record["batches"]
    assert len(expected) >= 3 * NUM_EPOCHS
    assert stream_batches(record, dataset, len(expected)) == expected
    if variation == "remove_unused_columns":
        assert set(expected[0][0]) == {"prompt"}  # TRL really dropped the other columns
    else:
        assert set(expected[0][0]) == {"prompt", "answer", "row_id"}


# ------------------------------------------------------------------------------------------ map-style, two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_two_ranks(output_dir: str) -> None:
    """Runs in each rank of `accelerate launch`: TRL's batches of this rank, for every variation."""
    dataset = make_dataset()
    records = {}
    for name, overrides in {**TRAINER_VARIATIONS, **TWO_RANK_VARIATIONS}.items():
        trainer = build_grpo_trainer(os.path.join(output_dir, name), dataset, **overrides)
        records[name] = trainer_record(trainer)
    # An iterable dataset: accelerate dispatches each global batch from rank 0 in consecutive slices.
    trainer = build_grpo_trainer(
        os.path.join(output_dir, "iterable"), dataset.to_iterable_dataset(), **TRAINER_VARIATIONS["num_iterations"]
    )
    records["iterable"] = trainer_record(trainer)
    rank = records["default"]["process_index"]
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)


def test_two_rank_streams_equal_each_rank_of_a_real_accelerate_launch(tmp_path, dataset):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()), os.path.abspath(__file__), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    for name in [*TRAINER_VARIATIONS, *TWO_RANK_VARIATIONS, "iterable"]:
        per_rank = [ranks[k][name] for k in range(2)]
        assert [r["process_index"] for r in per_rank] == [0, 1] and per_rank[0]["num_processes"] == 2
        for record in per_rank:
            expected = record["batches"]
            assert len(expected) >= 2 * NUM_EPOCHS, name
            data = dataset.to_iterable_dataset() if name == "iterable" else dataset
            assert stream_batches(record, data, len(expected)) == expected, (name, record["process_index"])
        # Together the ranks hold whole groups: each global batch is distinct prompts, each `num_generations` times.
        ng = per_rank[0]["num_generations"]
        for rank0, rank1 in zip(per_rank[0]["batches"], per_rank[1]["batches"], strict=True):
            ids = [json.dumps(row, sort_keys=True) for row in rank0 + rank1]
            groups = [ids[i : i + ng] for i in range(0, len(ids), ng)]
            assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == len(groups), name
        if name != "group_across_ranks":  # the split is exercised: the ranks hold different prompts
            assert per_rank[0]["batches"][0] != per_rank[1]["batches"][0], name


# ------------------------------------------------------------------------------------------ iterable datasets
def trl_iterable_batches(iterable, num_generations: int, unique_per_batch: int, seed: int, shuffle: bool, epochs):
    """TRL's iterable pipeline (`GRPOTrainer.get_train_dataloader`): `shuffle(seed)` then `repeat_iterable_dataset`,
    re-iterated per epoch after `set_epoch(epoch)`, as `Trainer` does. `repeat_count=1`: the repeats are skipped."""
    from trl.trainer.utils import repeat_iterable_dataset

    if shuffle:
        iterable = iterable.shuffle(seed=seed)
    repeated = repeat_iterable_dataset(iterable, mini_repeat_count=num_generations, batch_size=unique_per_batch)
    size = num_generations * unique_per_batch
    batches = []
    for epoch in range(epochs):
        repeated.set_epoch(epoch)
        records = list(repeated)
        assert len(records) % size == 0
        batches.extend(records[i : i + size] for i in range(0, len(records), size))
    return batches


@pytest.mark.parametrize(
    "num_generations,unique_per_batch,shuffle,seed",
    [(2, 3, True, 0), (4, 2, True, 17), (3, 5, False, 0), (1, 4, True, 5)],
)
def test_iterable_stream_equals_trl_iterable_pipeline(dataset, num_generations, unique_per_batch, shuffle, seed):
    epochs = 3
    expected = trl_iterable_batches(
        dataset.to_iterable_dataset(), num_generations, unique_per_batch, seed, shuffle, epochs
    )
    stream = PromptStream(
        dataset.to_iterable_dataset(),
        num_generations=num_generations,
        generation_batch_size=num_generations * unique_per_batch,
        shuffle=shuffle,
        seed=seed,
    )
    assert [stream.rows(i) for i in range(len(expected))] == expected
    per_epoch = len(dataset) // unique_per_batch
    assert len(expected) == epochs * per_epoch
    if shuffle:  # each epoch is reshuffled (otherwise the multi-epoch comparison proves little)
        assert expected[0] != expected[per_epoch]


def test_iterable_stream_equals_a_real_grpo_trainer_dataloader(tmp_path, dataset):
    trainer = build_grpo_trainer(
        str(tmp_path), dataset.to_iterable_dataset(), per_device_train_batch_size=3, num_generations=3,
        steps_per_generation=2, num_iterations=2, seed=11,
    )  # fmt: skip
    expected = trl_generation_batches(trainer)
    stream = PromptStream(
        dataset.to_iterable_dataset(),
        num_generations=3,
        generation_batch_size=trainer.args.generation_batch_size,
        shuffle=trainer.shuffle_dataset,
        seed=11,
    )
    assert len(expected) == NUM_EPOCHS * (len(dataset) // 2)
    assert [stream.rows(i) for i in range(len(expected))] == expected


def test_iterable_two_rank_split_is_the_consecutive_halves_of_the_global_batch(dataset):
    # accelerate dispatches an iterable's global batch to ranks in consecutive slices; the union is the 1-rank batch.
    def stream(process_index, num_processes):
        return PromptStream(
            dataset.to_iterable_dataset(), 4, 8, True, 3, process_index=process_index, num_processes=num_processes
        )

    whole, halves = stream(0, 1), [stream(0, 2), stream(1, 2)]
    for i in range(12):
        assert halves[0].rows(i) + halves[1].rows(i) == whole.rows(i)


# ------------------------------------------------------------------------------------------ access rules
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_skipping_ahead_equals_reading_every_batch(dataset, iterable):
    def make():
        data = dataset.to_iterable_dataset() if iterable else dataset
        return PromptStream(data, num_generations=2, generation_batch_size=8, shuffle=True, seed=5)

    every = make()
    all_batches = [every.rows(i) for i in range(25)]  # 23 rows, 4 prompts a batch: 5 per epoch, 5 epochs
    skipping = make()
    assert skipping.rows(1) == all_batches[1]
    assert skipping.rows(5) == all_batches[5]
    assert skipping.rows(6) == all_batches[6]
    assert skipping.rows(19) == all_batches[19]  # across epochs
    with pytest.raises(ValueError, match="cannot go back"):
        skipping.rows(19)
    with pytest.raises(ValueError, match="cannot go back"):
        skipping.rows(3)
    assert skipping.rows(24) == all_batches[24]  # still usable after a refused request


def test_columns_filter_keeps_only_the_named_columns(dataset):
    full = PromptStream(dataset, num_generations=2, generation_batch_size=4, shuffle=True, seed=0)
    kept = PromptStream(dataset, 2, 4, True, 0, columns=["prompt", "row_id"])
    for i in range(6):
        rows, filtered = full.rows(i), kept.rows(i)
        assert filtered == [{"prompt": r["prompt"], "row_id": r["row_id"]} for r in rows]


def test_a_dataset_smaller_than_one_generation_batch_is_refused(dataset):
    small = dataset.select(range(3))
    with pytest.raises(ValueError, match="fewer"):
        PromptStream(small, num_generations=2, generation_batch_size=8, shuffle=True, seed=0).rows(0)
    with pytest.raises(ValueError, match="fewer"):
        PromptStream(small.to_iterable_dataset(), 2, 8, True, 0).rows(0)


# ------------------------------------------------------------------------------------------ conversational check
_MESSAGES = [
    "What is 2+2?",
    "",
    ["a", "b"],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [{"content": "no role"}],
    [{"from": "human", "value": "sharegpt style"}],
    [["role", "user"]],
    {"role": "user", "content": "a bare message"},
    ({"role": "user", "content": "a tuple"},),
    None,
    42,
    [{"role": "user", "content": [{"type": "text", "text": "multimodal"}]}],
]


@pytest.mark.parametrize("prompt", _MESSAGES, ids=range(len(_MESSAGES)))
def test_is_conversational_prompt_agrees_with_trl(prompt):
    from trl.data_utils import is_conversational

    assert is_conversational_prompt(prompt) == is_conversational({"prompt": prompt})


def test_is_conversational_prompt_agrees_with_trl_on_generated_prompts():
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from trl.data_utils import is_conversational

    scalar = st.one_of(st.none(), st.integers(), st.text(max_size=5))
    message = st.dictionaries(st.sampled_from(["role", "content", "from", "value"]), scalar, max_size=3)
    prompt = st.one_of(
        scalar,
        message,
        st.lists(st.one_of(message, scalar), min_size=1, max_size=3),  # TRL reads the first element: non-empty
        st.tuples(message),
    )

    @settings(max_examples=300, deadline=None, database=None)
    @given(prompt)
    def agree(p):
        assert is_conversational_prompt(p) == is_conversational({"prompt": p})

    agree()


def test_stream_rows_of_conversational_dataset_are_detected_as_conversational(dataset):
    rows = PromptStream(dataset, 2, 4, True, 0).rows(0)
    assert all(is_conversational_prompt(r["prompt"]) for r in rows)
    plain = Dataset.from_dict({"prompt": [f"p{i}" for i in range(8)]})
    assert not any(is_conversational_prompt(r["prompt"]) for r in PromptStream(plain, 2, 4, True, 0).rows(0))


if __name__ == "__main__":
    torch.set_num_threads(1)
    _record_two_ranks(sys.argv[1])
    if torch.distributed.is_initialized():  # exit with no live gloo group (pytorch/pytorch#179291)
        torch.distributed.destroy_process_group()
