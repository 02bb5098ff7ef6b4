"""Server mode: a real `trl vllm-serve` server (TRL's command line, started through `vllm_serve_command`) on this
machine, driven with TRL's `VLLMClient`.

What runs on CPU: generation, full-weight sync through a shared filesystem, LoRA adapter-only sync. What does not:
TRL's NCCL weight sync (`VLLMClient.init_communicator` needs CUDA); that test is skipped without a GPU.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable: run in the vLLM environment (bash .ci/vllm_env.sh)")

import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import requests  # noqa: E402
import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from tests.support.vllm import (  # noqa: E402
    backend_context,
    hf_logits,
    perturb_,
    stores_for,
    tiny_model,
    tiny_prompts,
)
from trl_async.rollout.backends.vllm_server import (  # noqa: E402
    VLLMServerBackend,
    serve_environment,
    vllm_serve_command,
)
from trl_async.toy import tiny_model_path  # noqa: E402

TOLERANCE = 1e-3
STARTUP_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    # A small step budget, so that a 24-row batch needs several steps to prefill (see the seeded-batch check).
    extra = ["--kv-cache-memory-bytes", str(128 << 20), "--enable-lora", "--max-lora-rank", "8"]
    extra += ["--max-num-batched-tokens", "256"]
    command = vllm_serve_command(
        tiny_model_path(), extra, host="127.0.0.1", port=port, dtype="float32", enforce_eager=True
    )
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, env=serve_environment(lora=True), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"the server did not come up in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the server's own session: it and the engine processes it started
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def _check_behaviour_logprobs(model, prompts, ids, logps):
    for prompt, completion, mu in zip(prompts, ids, logps, strict=True):
        expected = torch.log_softmax(hf_logits(model, prompt, completion), -1)
        expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(mu, dtype=torch.float64), expected, atol=TOLERANCE)


def _served_logprobs_moved(model_before, prompts, ids, logps) -> float:
    moved = 0.0
    for prompt, completion, mu in zip(prompts, ids, logps, strict=True):
        stale = torch.log_softmax(hf_logits(model_before, prompt, completion), -1)
        stale = stale.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        moved = max(moved, (torch.tensor(mu, dtype=torch.float64) - stale).abs().max().item())
    return moved


@pytest.mark.slow
def test_full_weights_reach_the_server(server):
    reference = tiny_model()  # the weights the server loaded from disk
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMServerBackend(backend_context(model, frozen_store, trainable_store), base_url=server)
    try:
        assert backend.load() == 0
        perturb_(model, 0.05, torch.Generator().manual_seed(1))
        trainable_store.publish(model.named_parameters(), version=1)
        assert backend.update_weights() == 1
        prompts = tiny_prompts(6, seed=2)
        first = backend.generate(prompts, seed=5)
        ids, logps = first.to_lists()
        _check_behaviour_logprobs(model, prompts, ids, logps)
        assert _served_logprobs_moved(reference, prompts, ids, logps) > 50 * TOLERANCE

        # Per-row seeds: reproducible, and distinct across copies of one prompt.
        repeated = [prompts[0]] * 4
        a, b = backend.generate(repeated, seed=9), backend.generate(repeated, seed=9)
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert len({tuple(r) for r in a.to_lists()[0]}) > 1
        unseeded_ids, unseeded_logps = backend.generate(prompts).to_lists()
        _check_behaviour_logprobs(model, prompts, unseeded_ids, unseeded_logps)
        # More prompt tokens than one engine step takes (regression: seeded split prefills crashed vLLM on CPU).
        many = tiny_prompts(24, seed=6)
        assert sum(map(len, many)) > 256
        many_ids, many_logps = backend.generate(many, seed=7).to_lists()
        _check_behaviour_logprobs(model, many, many_ids, many_logps)
    finally:
        backend.close()


@pytest.mark.slow
def test_lora_adapter_only_updates_reach_the_server(server):
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = tiny_model(config)
    perturb_(model.get_base_model(), 0.02, torch.Generator().manual_seed(3), only_trainable=False)
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMServerBackend(backend_context(model, frozen_store, trainable_store), base_url=server)
    try:
        assert backend.load() == 0
        prompts = tiny_prompts(6, seed=4)
        ids, logps = backend.generate(prompts, seed=1).to_lists()
        _check_behaviour_logprobs(model, prompts, ids, logps)  # the perturbed base went in
        generator = torch.Generator().manual_seed(5)
        for version in (1, 2):
            perturb_(model, 0.3, generator)
            trainable_store.publish([(n, p) for n, p in model.named_parameters() if p.requires_grad], version)
            assert backend.update_weights() == version
            ids, logps = backend.generate(prompts, seed=1).to_lists()
            _check_behaviour_logprobs(model, prompts, ids, logps)
            with model.disable_adapter():
                assert _served_logprobs_moved(model, prompts, ids, logps) > 50 * TOLERANCE
        served = {m["id"] for m in requests.get(f"{server}/v1/models", timeout=10).json()["data"]}
        assert backend.lora_name in served
        assert not any(name.startswith("trl-async-policy-") and name != backend.lora_name for name in served)
    finally:
        backend.close()


def test_nccl_weight_sync_refuses_cpu():
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    with pytest.raises(ValueError, match="CUDA"):
        VLLMServerBackend(backend_context(model, frozen_store, trainable_store), weight_sync="nccl")


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only: TRL's VLLMClient.init_communicator runs vLLM's NCCL weight-transfer engine, which needs CUDA",
)
def test_nccl_weights_reach_the_server(server):
    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    backend = VLLMServerBackend(
        backend_context(model, frozen_store, trainable_store, device="cuda"),
        base_url=server,
        weight_sync="nccl",
    )
    try:
        backend.load()
        perturb_(model, 0.05, torch.Generator().manual_seed(1))
        trainable_store.publish(model.named_parameters(), version=1)
        assert backend.update_weights() == 1
        prompts = tiny_prompts(4, seed=2)
        ids, logps = backend.generate(prompts, seed=5).to_lists()
        _check_behaviour_logprobs(model, prompts, ids, logps)
    finally:
        backend.close()
