"""The in-process vLLM engine (full fine-tune): weight sync from the store, behaviour log-probs μ, output layout.

One engine for the whole module (start-up is seconds to tens of seconds on CPU); every test that changes the weights
publishes and syncs them, so the engine and the transformers reference always hold the same weights.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable: run in the vLLM environment (bash .ci/vllm_env.sh)")

import torch  # noqa: E402

from tests.support.vllm import (  # noqa: E402
    EOS,
    PAD,
    backend_context,
    engine_sequence_logprobs,
    generation_config,
    hf_logits,
    hf_sequence_logprobs,
    perturb_,
    processed_logprobs_reference,
    stores_for,
    tiny_model,
    tiny_prompts,
)
from trl_async.rollout.backends.vllm import VLLMBackend  # noqa: E402
from trl_async.rollout.backends.vllm_sampling import sampling_kwargs  # noqa: E402

TOLERANCE = 1e-3  # float32 engine vs float32 transformers, as the bar


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMBackend(
        backend_context(model, frozen_store, trainable_store, device="cpu"),
        # A small step budget (the tiny model's 256-token context is the least it may be): a 24-row batch of
        # ~17-token prompts then needs more than one step to prefill.
        engine_kwargs={"max_num_batched_tokens": 256},
    )
    assert backend.load() == 0
    yield model, trainable_store, backend
    backend.close()


def _fixed_sequences(n: int = 6) -> list[list[int]]:
    # Prompts followed by a fixed completion (the digits and the answer marker the tiny model was trained on).
    return [p + [19, 20, 16, 21, EOS] for p in tiny_prompts(n, seed=3)]


def test_weight_update_reaches_engine(engine):
    model, store, backend = engine
    sequences = _fixed_sequences()
    before = [torch.tensor(lp) for lp in engine_sequence_logprobs(backend, sequences)]
    for seq, lp in zip(sequences, before, strict=True):
        assert torch.allclose(lp.double(), hf_sequence_logprobs(model, seq), atol=TOLERANCE)

    perturb_(model, 0.05, torch.Generator().manual_seed(1))
    store.publish(model.named_parameters(), version=1)
    assert backend.update_weights() == 1
    assert backend.update_weights() == 1  # nothing new published: no reload
    after = [torch.tensor(lp) for lp in engine_sequence_logprobs(backend, sequences)]
    moved = max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))
    assert moved > 50 * TOLERANCE, "the perturbation is too small for this check to see a missed update"
    for seq, lp in zip(sequences, after, strict=True):
        assert torch.allclose(lp.double(), hf_sequence_logprobs(model, seq), atol=TOLERANCE)


SETTINGS = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 20},
    "min_p": {"min_p": 0.05},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "all": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_behaviour_logprobs_are_the_processed_distribution(engine, name):
    model, _, backend = engine
    settings = SETTINGS[name]
    temperature = settings.get("temperature", 1.0)
    backend.sampling_kwargs = sampling_kwargs(generation_config(**settings), temperature, [EOS])
    try:
        prompts = tiny_prompts(8, seed=5)
        out = backend.generate(prompts, seed=11)
    finally:
        backend.sampling_kwargs = sampling_kwargs(generation_config(), 1.0, [EOS])
    ids, logps = out.to_lists()
    reference_kwargs = {k: v for k, v in settings.items() if k != "temperature"}
    for prompt, completion, mu in zip(prompts, ids, logps, strict=True):
        logits = hf_logits(model, prompt, completion)
        expected = processed_logprobs_reference(logits, prompt, completion, temperature, **reference_kwargs)
        assert torch.isfinite(expected).all(), "a sampled token lies outside the reference's kept set"
        assert torch.allclose(torch.tensor(mu, dtype=torch.float64), expected, atol=TOLERANCE), name
    if name == "all":
        # The processors change the numbers: μ is not the plain log_softmax(logits / T).
        prompt, completion, mu = prompts[0], ids[0], logps[0]
        plain = torch.log_softmax(hf_logits(model, prompt, completion) / temperature, -1)
        plain = plain.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(mu, dtype=torch.float64) - plain).abs().max() > 10 * TOLERANCE


def test_output_layout_and_seeds(engine):
    _, _, backend = engine
    prompt = tiny_prompts(1, seed=7)[0]
    prompts = [prompt] * 6  # GRPO repeats each prompt: per-row seeds must still differ
    first = backend.generate(prompts, seed=3)
    again = backend.generate(prompts, seed=3)
    other = backend.generate(prompts, seed=4)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)
    assert len({tuple(row) for row in first.to_lists()[0]}) > 1, "identical prompts got identical completions"

    ids, mask, logps = first.completion_ids, first.completion_mask, first.logprobs
    assert ids.dtype == torch.long and mask.dtype == torch.bool and logps.dtype == torch.float32
    for row in range(ids.shape[0]):
        tokens = ids[row].tolist()
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any(), "mask is not a prefix"
        eos_at = [i for i, t in enumerate(tokens[:n]) if t == EOS]
        if eos_at:  # True up to and including the first EOS, nothing after it
            assert eos_at == [n - 1]
        else:  # no EOS: the row ran to max_new_tokens
            assert n == backend.sampling_kwargs["max_tokens"]
        assert all(t == PAD for t in tokens[n:])
        assert (logps[row, n:] == 0).all() and (logps[row, :n] < 0).all()


def test_several_batches_in_one_engine_run_sample_what_each_samples_alone(engine):
    """`generate_batches`: every batch's rows in one engine run, each row seeded from its batch's seed, so each batch
    gets the completions it gets alone; the outputs are cut to each batch's own longest completion."""
    from trl_async.rollout.backends import SeededPrompts

    _, _, backend = engine
    first, second = tiny_prompts(4, seed=21), tiny_prompts(6, seed=22)
    alone = [backend.generate(first, seed=5), backend.generate(second, seed=6)]
    together = backend.generate_batches([SeededPrompts(first, 5), SeededPrompts(second, 6)])
    for single, shared in zip(alone, together, strict=True):
        assert torch.equal(single.completion_ids, shared.completion_ids)
        assert torch.equal(single.logprobs, shared.logprobs)


def test_seeded_batch_larger_than_one_engine_step(engine):
    """Regression: vLLM 0.32's CPU engine crashed on seeded requests whose prefill spans two steps."""
    model, _, backend = engine
    prompts = tiny_prompts(24, seed=13)
    assert sum(map(len, prompts)) > 256
    ids, logps = backend.generate(prompts, seed=2).to_lists()
    assert len(ids) == 24
    prompt, completion, mu = prompts[-1], ids[-1], logps[-1]
    expected = torch.log_softmax(hf_logits(model, prompt, completion), -1)
    expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(mu, dtype=torch.float64), expected, atol=TOLERANCE)


def test_unhonourable_settings_fail_before_the_engine_starts():
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        VLLMBackend(backend_context(model, frozen_store, trainable_store, generation_config(no_repeat_ngram_size=3)))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMBackend(backend_context(model, frozen_store, trainable_store), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMBackend(backend_context(model, frozen_store, trainable_store), gpu_memory_utilization=0.5)
