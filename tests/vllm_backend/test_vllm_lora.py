"""LoRA with the in-process engine: the frozen base goes in once, every update sends only the adapter."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable: run in the vLLM environment (bash .ci/vllm_env.sh)")

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from tests.support.vllm import (  # noqa: E402
    EOS,
    backend_context,
    engine_sequence_logprobs,
    hf_logits,
    hf_sequence_logprobs,
    perturb_,
    stores_for,
    tiny_model,
    tiny_prompts,
)
from trl_async.rollout.backends.vllm import VLLMBackend  # noqa: E402
from trl_async.rollout.backends.vllm_weights import merge_lora_weights  # noqa: E402

TOLERANCE = 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**overrides):
    return LoraConfig(**{"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS, **overrides})


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = tiny_model(lora_config())
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMBackend(backend_context(model, frozen_store, trainable_store, device="cpu"))
    assert backend.load() == 0
    yield model, frozen_store, trainable_store, backend
    backend.close()


def test_only_the_adapter_travels(engine):
    model, frozen_store, trainable_store, _ = engine
    assert trainable_store.names and all(".lora_A." in n or ".lora_B." in n for n in trainable_store.names)
    assert not any("lora_" in n for n in frozen_store.names)
    assert trainable_store.num_bytes < 0.2 * frozen_store.num_bytes


def test_adapter_updates_reach_engine(engine):
    model, _, store, backend = engine
    sequences = [p + [19, 20, 16, 21, EOS] for p in tiny_prompts(6, seed=3)]
    # v0: PEFT initialises lora_B to zero, so the engine serves the base model.
    with model.disable_adapter():
        base = [hf_sequence_logprobs(model, s) for s in sequences]
    for lp, ref in zip(engine_sequence_logprobs(backend, sequences), base, strict=True):
        assert torch.allclose(torch.tensor(lp, dtype=torch.float64), ref, atol=TOLERANCE)

    generator = torch.Generator().manual_seed(2)
    for version in (1, 2):  # a second swap: the new adapter replaces the old one
        perturb_(model, 0.3, generator)
        store.publish([(n, p) for n, p in model.named_parameters() if p.requires_grad], version=version)
        assert backend.update_weights() == version
        served = [torch.tensor(lp, dtype=torch.float64) for lp in engine_sequence_logprobs(backend, sequences)]
        expected = [hf_sequence_logprobs(model, s) for s in sequences]
        moved = max((e - b).abs().max().item() for e, b in zip(expected, base, strict=True))
        assert moved > 50 * TOLERANCE, "the adapter is too small for this check to see a missed update"
        for got, ref in zip(served, expected, strict=True):
            assert torch.allclose(got, ref, atol=TOLERANCE)
    assert backend.llm.llm_engine.list_loras() == {backend.lora_request.lora_int_id}, "old adapters are not dropped"


def test_behaviour_logprobs_under_the_adapter(engine):
    model, _, _, backend = engine
    prompts = tiny_prompts(6, seed=9)
    ids, logps = backend.generate(prompts, seed=1).to_lists()
    for prompt, completion, mu in zip(prompts, ids, logps, strict=True):
        expected = torch.log_softmax(hf_logits(model, prompt, completion), -1)
        expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(mu, dtype=torch.float64), expected, atol=TOLERANCE)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"use_rslora": True}, {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 32}}],
    ids=["plain", "rslora", "patterns"],
)
def test_merged_weights_match_peft_merge(overrides):
    """The NCCL server path sends LoRA merged into the base: check the merge against PEFT's own merge_and_unload."""
    model = tiny_model(lora_config(**overrides))
    perturb_(model, 0.3, torch.Generator().manual_seed(4))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    merged = merge_lora_weights(frozen, adapter, model.peft_config["default"], "default")
    reference = dict(model.merge_and_unload().named_parameters())
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def test_unsupported_adapters_are_refused_before_start():
    model = tiny_model(lora_config(use_dora=True))
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMBackend(backend_context(model, frozen_store, trainable_store))
    with pytest.raises(ValueError, match="DoRA"):
        backend.load()
    backend.close()
