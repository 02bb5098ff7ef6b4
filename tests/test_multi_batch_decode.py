"""Several generation batches in one decode (wave 5, DESIGN §8): the schedule that keeps the pipeline full, the queue
reserving a block, each batch sampled from its own seed, the static-cache decode's μ, and the generation process's
fast start. The trainer-level guarantees (no row older than `max_staleness` reaches a loss, tags true) run in
`tests/test_engine.py` with blocks; the config's choices and errors in `tests/test_bad_inputs.py` and here."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.test_backends import reference_logprobs
from trl_async import AsyncGRPOConfig
from trl_async.config.grpo import items_per_decode
from trl_async.rollout.backends import (
    BackendContext,
    GenerationOutput,
    ModelSpec,
    SeededPrompts,
    generate_with_behaviour_logprobs,
    generation_config_for_rollouts,
)
from trl_async.rollout.backends.hf import HFBackend, _SeededSampler
from trl_async.rollout.queue import StalenessBoundedQueue
from trl_async.rollout.weights import SharedWeightStore
from trl_async.schedule import last_use_version, pipelined_max_staleness
from trl_async.toy import tiny_model_path


# ------------------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize(
    ("g", "a", "expected"),
    [
        # TRL's default schedule: one batch per optimizer step. A block of k decoded while the trainer trains the
        # previous k: its batches are k .. 2k-1 versions old when used.
        (1, 1, [1, 3, 5, 7]),
        # steps_per_generation=4, gradient_accumulation_steps=1: a batch is trained on across 4 optimizer steps
        # (usage span 3); the block's predecessor spans 4k versions.
        (4, 1, [4, 12, 20, 28]),
        # gradient_accumulation_steps=4 per batch of one micro-step: 4 batches per version.
        (1, 4, [1, 2, 2, 3]),
    ],
    ids=["default", "four_steps_per_batch", "four_batches_per_step"],
)
def test_pipelined_bound_by_hand(g, a, expected):
    """Worked by hand from the schedule (f(n) = ⌊n·g/a⌋, l(n) = ⌊(n·g + g − 1)/a⌋): the block [r, r+k) starts when
    the trainer takes r−k+1 and must be usable at l(r+k−1); k = 1 is the engine's bound since wave 1."""
    assert [pipelined_max_staleness(k, g, a) for k in (1, 2, 3, 4)] == expected


def _simulate(max_staleness: int, block: int, decode_time: float, train_time: float, items: int = 24):
    """A generator that decodes `block` batches per call (`decode_time` each call) and a trainer that trains one batch
    per optimizer step (`train_time`), in simulated time, on the real queue's gate (`_admissible`, the condition of
    `reserve_block`). Returns the generator's idle time before each block after the first, and each batch's staleness
    at use (the version that trains on it minus the version whose weights the generator had loaded)."""
    queue = StalenessBoundedQueue(max_staleness=max_staleness, start_index=0)
    counters = queue._counters
    ready_at, loaded = {}, {}
    waits, now, version = [], 0.0, 0
    generator_idle_since, generator_free = 0.0, 0.0
    trainer_busy_until, training = None, False
    try:
        while int(counters.consumed) < items and now < 1000:
            if training and trainer_busy_until <= now:  # a step ends: a new version is published
                training, version = False, version + 1
                queue.publish(version)
            if generator_free <= now:
                first = int(counters.reserved) if counters.reserved >= 0 else 0
                count, _ = queue._admissible(first, block, awaited=False, wait_for_weights=True)
                if count == block:
                    if first:
                        waits.append(now - generator_idle_since)
                    counters.reserved = first + block
                    for index in range(first, first + block):
                        ready_at[index], loaded[index] = now + decode_time, version
                    generator_free = generator_idle_since = now + decode_time
            index = int(counters.consumed)
            if not training and ready_at.get(index, math.inf) <= now:
                counters.consumed = index + 1
                training, trainer_busy_until = True, now + train_time
            now += 0.25
    finally:
        queue.cleanup()
    staleness = [last_use_version(index) - loaded[index] for index in range(int(counters.consumed))]
    return waits, staleness


@pytest.mark.parametrize("block", [1, 2, 4])
def test_pipelined_bound_lets_a_slower_generator_decode_blocks_back_to_back(block):
    """With the bound `pipelined_max_staleness(k)`, a generator slower than the trainer decodes its blocks back to back
    once the pipeline is full (its only wait is the second block's, while the trainer starts), and every batch is
    within the bound, the block's last ones exactly at it. One version less and it waits before every block."""
    bound = pipelined_max_staleness(block, 1, 1)
    waits, staleness = _simulate(bound, block, decode_time=block * 2.0, train_time=1.0)
    assert len(waits) >= 4 and max(waits[1:]) == 0.0, waits
    assert max(staleness) == bound, staleness
    if block > 1:  # (one version less than 1 is on-policy: the generator then waits for every step)
        tighter_waits, tighter_staleness = _simulate(bound - 1, block, decode_time=block * 2.0, train_time=1.0)
        assert min(tighter_waits[1:]) > 0.0, tighter_waits
        assert max(tighter_staleness) == bound - 1


# --------------------------------------------------------------------------------------------------------- queue
def test_a_block_is_reserved_whole_when_every_batch_of_it_is_admissible():
    """`reserve_block(k)` waits until all k batches may be generated (room and weights for the last of them), and its
    `min_version` is the last batch's gate; until then it reserves nothing."""
    queue = StalenessBoundedQueue(max_staleness=3, start_index=0)
    queue.publish(0)  # the start-up weights
    try:
        first, count, min_version = queue.reserve_block(2, timeout=1.0)
        assert (first, count) == (0, 2) and min_version == last_use_version(1) - 3
        # Items 2 and 3: item 3 is last used at version 3 and needs weights >= 0 (published: 0) and room (4 allowed).
        assert queue.reserve_block(2, timeout=1.0)[:2] == (2, 2)
        # Items 4 and 5 need weights >= 2 and room: nothing until the consumer took items and v2 is published.
        with pytest.raises(TimeoutError):
            queue.reserve_block(2, timeout=0.3)
        assert queue.qsize() == 4  # nothing half-reserved
        queue._counters.consumed = 2
        queue.publish(1)
        with pytest.raises(TimeoutError):  # room for 2 now, but v2 not yet published
            queue.reserve_block(2, timeout=0.3)
        queue.publish(2)
        assert queue.reserve_block(2, timeout=1.0) == (4, 2, last_use_version(5) - 3)
    finally:
        queue.cleanup()


def test_a_waiting_consumer_gets_the_admissible_part_of_a_block_at_once():
    """When the trainer is already waiting for the block's first batch, the generator takes the batches it may
    generate now (at least that one) instead of waiting for the whole block: a full block could keep the trainer
    waiting for weights only it can publish."""
    queue = StalenessBoundedQueue(max_staleness=3, start_index=0)
    try:
        queue._counters.reserved = 4
        queue._counters.produced = queue._counters.consumed = 4
        # The trainer waits for item 4 at version 4, published 1 (a schedule it did not predict): item 4 alone is
        # admissible with the waiting consumer's version, item 5 needs weights >= 2.
        queue._counters.waiting_last_use = 4
        queue._counters.waiting_index = 4
        queue.publish(1)
        assert queue.reserve_block(2, timeout=1.0) == (4, 1, 1)
    finally:
        queue.cleanup()


def test_nothing_is_reserved_beyond_the_end_of_the_run_but_what_the_consumer_waits_for():
    """`set_end(5)`: items 0..5 are all the consumer will need. The last block holds what is left (items 4 and 5 of a
    block of 3), nothing after it is reserved, an eviction makes room for one more, and an item the consumer waits
    for is admitted even past the end (a mispredicted end costs no deadlock)."""
    queue = StalenessBoundedQueue(max_staleness=100, capacity=100, start_index=0)
    queue.publish(0)
    try:
        queue.set_end(5)
        assert queue.reserve_block(3, timeout=1.0)[:2] == (0, 3)
        assert queue.reserve_block(3, timeout=1.0)[:2] == (3, 3)
        with pytest.raises(TimeoutError):
            queue.reserve_block(3, timeout=0.3)
        queue._counters.evicted_items = 1  # one item was evicted: the consumer needs item 6 as well
        assert queue.reserve_block(3, timeout=1.0)[:2] == (6, 1)
        queue._counters.waiting_last_use, queue._counters.waiting_index = 7, 7
        assert queue.reserve_block(3, timeout=1.0)[:2] == (7, 1)
    finally:
        queue.cleanup()


def test_reserve_block_refuses_a_block_of_no_batches():
    queue = StalenessBoundedQueue(max_staleness=1, start_index=0)
    try:
        with pytest.raises(ValueError, match="max_items"):
            queue.reserve_block(0)
    finally:
        queue.cleanup()


# -------------------------------------------------------------------------------------------------------- config
def _config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, bf16=False, use_cpu=True,
        report_to="none",
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


@pytest.mark.parametrize(
    ("overrides", "bound", "items"),
    [
        (dict(loss_type="dapo"), 1, 1),  # one batch per decode by default, the bound since wave 1
        (dict(loss_type="m2po"), 1, 1),  # M2PO too (blocks of 2 cost the main job accuracy: docs/staleness.md)
        (dict(loss_type="dapo", max_rows_per_decode=32), 7, 4),  # the user's rows: 4 batches of 8, bound 2·4 − 1
        (dict(loss_type="m2po", max_staleness=8), 8, 4),  # the user's bound admits blocks of 4 (2·5 − 1 = 9 > 8)
        (dict(loss_type="m2po", max_staleness=8, max_rows_per_decode=16), 8, 2),  # ... capped by the rows
        (dict(loss_type="m2po", max_staleness=2), 2, 1),  # a bound of 2 keeps blocks of 1
        (dict(loss_type="m2po", fixed_staleness=4), 4, 1),  # fixed staleness: each batch with its own weights
        (dict(loss_type="m2po", async_generation=False), 1, 1),  # synchronous: TRL's generation, one batch
        # steps_per_generation=2 (gradient_accumulation_steps=1): a batch is trained on across 2 steps, so even one
        # batch per decode needs 2; a block of 2 batches (16 rows each) needs 6 (`pipelined_max_staleness(2, 2, 1)`).
        (dict(loss_type="m2po", steps_per_generation=2), 2, 1),
        (dict(loss_type="m2po", steps_per_generation=2, max_rows_per_decode=32), 6, 2),
    ],
    ids=["dapo", "m2po", "rows_set", "bound_set", "bound_and_rows_set", "small_bound", "fixed", "sync", "spg2",
         "spg2_rows_set"],
)
def test_the_bound_and_the_batches_per_decode_a_config_gets(tmp_path, overrides, bound, items):
    args = _config(tmp_path, **overrides)
    assert args.max_staleness == bound
    assert items_per_decode(args) == items


def test_an_agentic_run_decodes_one_batch_at_a_time(tmp_path):
    """TRL's multi-turn loop samples one batch's turns in several calls: blocks do not apply (the bound stays)."""
    args = _config(tmp_path, loss_type="m2po", max_rows_per_decode=16)
    assert items_per_decode(args, agentic=True) == 1


def test_rows_per_decode_from_the_command_line_is_an_integer(tmp_path):
    """`--max_rows_per_decode 32` arrives as the string '32' (HfArgumentParser parses the field as str)."""
    args = _config(tmp_path, loss_type="m2po", max_rows_per_decode="32")
    assert args.max_rows_per_decode == 32 and items_per_decode(args) == 4 and args.max_staleness == 7


# ------------------------------------------------------------------------------------------------------ sampling
def test_the_seeded_sampler_draws_from_the_scores_distribution():
    """Inverse-CDF draws from each row's softmax(scores): empirical frequencies within 5 standard errors of the
    probabilities computed apart, a token of probability 0 (-inf, as top-k leaves them) never drawn."""
    scores = torch.tensor(
        [
            [2.0, 1.0, 0.0, -1.0, -float("inf"), 0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0, -float("inf")],
            [-float("inf"), -float("inf"), 5.0, -float("inf"), 4.0, -float("inf")],
        ]
    )
    probabilities = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    sampler = _SeededSampler([(3, 123)], torch.device("cpu"))
    draws = 20_000
    counts = torch.zeros_like(scores)
    for _ in range(draws):
        out = sampler(None, scores)
        chosen = out.argmax(dim=-1)
        assert ((out == 0).sum(dim=-1) == 1).all() and torch.isinf(out).sum() == out.numel() - 3
        counts[torch.arange(3), chosen] += 1
    frequencies = counts / draws
    standard_error = torch.sqrt(probabilities * (1 - probabilities) / draws)
    assert (counts[probabilities == 0] == 0).all()
    assert ((frequencies - probabilities).abs() <= 5 * standard_error + 1e-12).all(), (frequencies, probabilities)


def test_each_batch_draws_from_its_own_generator():
    """Rows of a batch draw the same numbers whatever is decoded beside them: batch B's draws are the same after
    batch A as alone, and differ with another seed."""
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    together = _SeededSampler([(2, 1), (4, 2)], torch.device("cpu"))
    alone = _SeededSampler([(4, 2)], torch.device("cpu"))
    other = _SeededSampler([(4, 3)], torch.device("cpu"))
    for _ in range(5):
        joint = together(None, scores).argmax(-1)
        assert torch.equal(joint[2:], alone(None, scores[2:]).argmax(-1))
    differs = [
        not torch.equal(alone(None, scores[2:]).argmax(-1), other(None, scores[2:]).argmax(-1)) for _ in range(5)
    ]
    assert any(differs)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    config = GenerationConfig(
        do_sample=True, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    first = [tokenizer(f"What is {i}+{3 * i}?")["input_ids"] for i in range(4) for _ in range(2)]
    second = [tokenizer(f"What is {7 * i}+{i}? Think.")["input_ids"] for i in range(3) for _ in range(4)]
    return tokenizer, model, generation_config_for_rollouts(config), first, second


def _decode(tiny, prompt_ids, segments, model=None):
    tokenizer, tiny_model, config, _, _ = tiny
    return generate_with_behaviour_logprobs(
        model or tiny_model, prompt_ids, config, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu",
        segments=segments,
    )  # fmt: skip


def test_a_batch_decoded_beside_another_samples_what_it_samples_alone(tiny):
    """Two generation batches (8 and 12 rows, different prompt lengths) in one `generate` call: each gets the tokens
    it gets decoded alone with its seed, cut to its own longest completion, with μ exact (recomputed row by row with
    a full forward)."""
    _, model, _, first, second = tiny
    alone = [_decode(tiny, first, [(8, 11)]), _decode(tiny, second, [(12, 12)])]
    joint = _decode(tiny, first + second, [(8, 11), (12, 12)]).split([8, 12])
    for single, shared, prompts in zip(alone, joint, (first, second), strict=True):
        assert torch.equal(single.completion_ids, shared.completion_ids)
        assert torch.equal(single.completion_mask, shared.completion_mask)
        mask = shared.completion_mask
        reference = reference_logprobs(model, prompts, shared.completion_ids, mask, [])
        assert (shared.logprobs - reference).abs()[mask].max() < 1e-4
    assert not torch.equal(alone[0].completion_ids, _decode(tiny, first, [(8, 99)]).completion_ids)


def test_split_cuts_each_batch_to_its_own_longest_completion():
    ids = torch.tensor([[5, 2, 0, 0], [6, 7, 2, 0], [8, 2, 0, 0]])
    mask = ids != 0
    out = GenerationOutput(completion_ids=ids, completion_mask=mask, logprobs=-mask.float(), token_versions=ids * 0)
    first, second = out.split([2, 1])
    assert first.completion_ids.tolist() == [[5, 2, 0], [6, 7, 2]] and second.completion_ids.tolist() == [[8, 2]]
    assert second.token_versions.shape == (1, 2) and first.policy_logprobs is None
    with pytest.raises(ValueError, match="add up"):
        out.split([1, 1])


# ------------------------------------------------------------------------------------------------ the hf backend
def _stores(model, trainable=lambda name: True):
    named = list(model.named_parameters())
    frozen = [(n, p) for n, p in named if not trainable(n)]
    train = [(n, p) for n, p in named if trainable(n)]
    frozen_store = SharedWeightStore(frozen) if frozen else None
    if frozen_store is not None:
        frozen_store.publish(frozen, 0)
    trainable_store = SharedWeightStore(train)
    trainable_store.publish(train, 0)
    return frozen_store, trainable_store


def _backend(tiny, model, frozen_store, trainable_store, peft_config=None, **options):
    tokenizer, _, config, _, _ = tiny
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    context = BackendContext(
        model_spec=ModelSpec(config=base.config, dtype=torch.float32, peft_config=peft_config),
        frozen_store=frozen_store, trainable_store=trainable_store, generation_config=config, temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, device="cpu",
    )  # fmt: skip
    backend = HFBackend(context, **options)
    backend.load()
    return backend


def test_the_generation_process_builds_its_lora_copy_from_the_published_weights_without_a_copy_of_the_base(tiny):
    """The fast start: the model is built on `meta` and takes the trainer's tensors. The frozen base is the shared
    memory itself (no second copy), the output embedding stays tied to the input one, the adapter is the trainer's,
    and the copy samples exactly what the trainer's model computes (μ against a full forward of the trainer's)."""
    from peft import LoraConfig, get_peft_model

    _, _, _, first, _ = tiny
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    assert trainer_model.config.tie_word_embeddings  # the case the generator must tie again
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer_model = get_peft_model(trainer_model, lora).eval()
    with torch.no_grad():  # an adapter that changes the policy
        for name, parameter in trainer_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    frozen_store, trainable_store = _stores(trainer_model, trainable=lambda name: "lora_" in name)
    backend = _backend(tiny, trainer_model, frozen_store, trainable_store, peft_config=lora)
    parameters = dict(backend.model.named_parameters())
    for name, buffer in frozen_store.buffers.items():  # the same memory, not a copy
        assert parameters[name].data_ptr() == buffer.data_ptr(), name
    generation_model = backend.model.get_base_model()
    assert generation_model.lm_head.weight is generation_model.model.embed_tokens.weight
    out = backend.generate(first, seed=5)
    reference = reference_logprobs(trainer_model, first, out.completion_ids, out.completion_mask, [])
    assert (out.logprobs - reference).abs()[out.completion_mask].max() < 1e-4


def test_a_parameter_the_trainer_does_not_publish_is_an_error_naming_it(tiny):
    """Built on `meta`, a parameter without published weights would have no values: refused, named."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    named = [(n, p) for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    store = SharedWeightStore(named)
    store.publish(named, 0)
    with pytest.raises(RuntimeError, match="publishes no weights for .*norm.weight"):
        _backend(tiny, model, None, store)


def test_the_static_cache_decode_samples_what_the_dynamic_one_does_with_exact_mu(tiny):
    """The CUDA-graph path's shapes on the CPU (where transformers does not compile): a static KV cache, the prompts
    padded to a multiple of 64 tokens and every call to the block's rows with dropped rows. Each batch samples the
    same tokens as the dynamic-cache decode, and μ is exact against a full forward."""
    _, model, _, first, second = tiny
    frozen_store, trainable_store = _stores(model)
    static = _backend(tiny, model, frozen_store, trainable_store, cuda_graphs=True, decode_rows=24)
    dynamic = _backend(tiny, model, frozen_store, trainable_store)
    batches = [SeededPrompts(first, 3), SeededPrompts(second, 4)]
    assert static.generation_config.cache_implementation == "static"
    for got, expected, prompts in zip(
        static.generate_batches(batches), dynamic.generate_batches(batches), (first, second), strict=True
    ):
        assert torch.equal(got.completion_ids, expected.completion_ids)
        mask = got.completion_mask
        reference = reference_logprobs(model, prompts, got.completion_ids, mask, [])
        assert (got.logprobs - reference).abs()[mask].max() < 1e-4
    assert static.compile_fallbacks == 0


def test_a_failed_compilation_falls_back_to_eager_decoding_and_is_counted(tiny):
    """A compiler that fails (a backend torch.compile cannot load, compiling on the CPU as on a GPU) does not fail
    the batch: the decode runs eagerly, the same draws, and the fallback is counted (`async/cuda_graphs_fallbacks`)."""
    from transformers import CompileConfig

    _, model, _, first, _ = tiny
    frozen_store, trainable_store = _stores(model)
    backend = _backend(tiny, model, frozen_store, trainable_store, cuda_graphs=True, decode_rows=8)
    broken = CompileConfig(backend="no_such_compiler_backend", fullgraph=False)
    broken._compile_all_devices = True  # compile on the CPU too, where transformers would not
    backend.generation_config.compile_config = broken
    eager = _backend(tiny, model, frozen_store, trainable_store)
    out = backend.generate(first, seed=6)
    assert backend.compile_fallbacks == 1 and not backend.cuda_graphs
    assert torch.equal(out.completion_ids, eager.generate(first, seed=6).completion_ids)


def test_a_model_error_under_cuda_graphs_is_not_taken_for_a_compile_failure(tiny):
    """Only the compiler's own errors fall back; an error of the run (a token id outside the vocabulary) is raised as
    it is, and CUDA graphs stay on."""
    _, model, _, _, _ = tiny
    frozen_store, trainable_store = _stores(model)
    backend = _backend(tiny, model, frozen_store, trainable_store, cuda_graphs=True, decode_rows=2)
    with pytest.raises(IndexError):
        backend.generate([[model.config.vocab_size + 5, 7]], seed=1)
    assert backend.compile_fallbacks == 0 and backend.cuda_graphs


def test_rows_per_decode_in_whole_batches(tmp_path):
    """Rows are decoded in whole generation batches: a cap of 20 rows with batches of 8 gives 2 per decode."""
    args = _config(tmp_path, loss_type="m2po", max_staleness=9, max_rows_per_decode=20)
    assert items_per_decode(args) == 2 == math.floor(20 / 8)
