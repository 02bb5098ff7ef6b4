"""A tiny end-to-end generation loop: a daemonic spawned child hosts the engine, as the generation process does, and
20 batches alternate with weight updates; every batch must come from the weights it is tagged with."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable: run in the vLLM environment (bash .ci/vllm_env.sh)")

import queue  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402

from tests.support.vllm import (  # noqa: E402
    engine_child,
    generation_config,
    hf_logits,
    model_spec,
    perturb_,
    stores_for,
    tiny_model,
    tiny_prompts,
)

TOLERANCE = 1e-3
NUM_BATCHES = 20


def _receive(results, process, timeout=300.0):
    try:
        message = results.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"the engine child sent nothing in {timeout:.0f}s (alive: {process.is_alive()})")
    if message[0] == "error":
        pytest.fail(f"the engine child failed:\n{message[1]}")
    return message


@pytest.mark.slow
def test_generation_loop_with_weight_updates_in_a_daemonic_child():
    ctx = torch_mp.get_context("spawn")
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    requests, results = ctx.Queue(), ctx.Queue()
    process = ctx.Process(
        target=engine_child,
        args=(model_spec(model), frozen_store, trainable_store, generation_config(10), requests, results),
        daemon=True,
    )
    process.start()
    try:
        _, version, children = _receive(results, process)
        assert version == 0
        assert children == 0, "vLLM started processes inside the daemonic child"
        generator = torch.Generator().manual_seed(0)
        last_beats, distinct = 0, set()
        for step in range(1, NUM_BATCHES + 1):
            perturb_(model, 0.02, generator)
            trainable_store.publish(model.named_parameters(), version=step)
            prompts = tiny_prompts(4, seed=step)
            requests.put((step, prompts, step))
            _, version, ids, logps, beats = _receive(results, process)
            assert version == step, "the batch was not generated with the newest published weights"
            assert beats > last_beats, "generation did not beat"
            last_beats = beats
            for prompt, completion, mu in zip(prompts, ids, logps, strict=True):
                expected = torch.log_softmax(hf_logits(model, prompt, completion), -1)
                expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
                assert torch.allclose(torch.tensor(mu, dtype=torch.float64), expected, atol=TOLERANCE), step
                distinct.add(tuple(completion))
        assert len(distinct) > NUM_BATCHES  # it really sampled
        requests.put(None)
        process.join(60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)
