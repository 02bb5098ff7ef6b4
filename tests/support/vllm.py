"""Shared pieces of the vLLM tests: the tiny model, its stores, and independent references computed with transformers."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trl_async.rollout.backends import BackendContext, ModelSpec
from trl_async.rollout.weights import SharedWeightStore, named_frozen_parameters, named_trainable_parameters
from trl_async.toy import make_arithmetic_dataset, tiny_model_path

EOS = 2
PAD = 0
SKIP_REASON = (
    "vLLM is not importable here: these tests run in the vLLM environment (`bash .ci/vllm_env.sh`, docs/vllm.md)."
)


def tiny_model(peft_config=None):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(peft_config))
    return model


def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted arithmetic prompts, tokenized as the generation process tokenizes them."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    rows = make_arithmetic_dataset(num_train=n, num_test=0, seed=seed)["train"]["prompt"]
    return tokenizer.apply_chat_template(list(rows), add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def stores_for(model) -> tuple[SharedWeightStore | None, SharedWeightStore]:
    """The stores the trainer publishes into: trainable tensors, and (when there are any) the frozen ones."""
    frozen = named_frozen_parameters(model)
    frozen_store = SharedWeightStore(frozen) if frozen else None
    trainable_store = SharedWeightStore(named_trainable_parameters(model))
    if frozen_store is not None:
        frozen_store.publish(frozen, version=0)
    trainable_store.publish(named_trainable_parameters(model), version=0)
    return frozen_store, trainable_store


def model_spec(model) -> ModelSpec:
    peft_config = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    config = model.get_base_model().config if peft_config is not None else model.config
    return ModelSpec(config=config, dtype=torch.float32, peft_config=peft_config)


def generation_config(max_new_tokens: int = 12, **sampling) -> GenerationConfig:
    # The same fields TRL's GRPOTrainer puts into its GenerationConfig.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=[EOS], **sampling
    )


def backend_context(model, frozen_store, trainable_store, config: GenerationConfig | None = None, **fields):
    """What the tiny model's backends are built from: its stores, `config` (default `generation_config()`),
    temperature 1, its EOS and padding ids; `fields` set the rest (device, heartbeat)."""
    config = generation_config() if config is None else config
    return BackendContext(model_spec(model), frozen_store, trainable_store, config, 1.0, [EOS], PAD, **fields)


def perturb_(model, scale: float, generator: torch.Generator, only_trainable: bool = True) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not only_trainable:
                p.add_(scale * torch.randn(p.shape, generator=generator))


@torch.no_grad()
def hf_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Raw next-token logits (float64) at each completion position, from one transformers forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def hf_sequence_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t), t >= 1, under transformers at temperature 1."""
    logits = hf_logits(model, sequence[:1], sequence[1:])
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


def processed_logprobs_reference(
    logits: torch.Tensor,
    prompt: list[int],
    completion: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> torch.Tensor:
    """log-probability of each sampled token under the distribution that sampled it, re-derived step by step.

    vLLM's documented order (vllm/v1/sample/sampler.py): repetition penalty on the raw logits over prompt and
    generated tokens (CTRL, Keskar et al. 2019: divide positive logits, multiply negative ones), temperature, min-p
    (drop p < min_p * p_max; Nguyen et al. 2024), top-k (keep the k largest), top-p (Holtzman et al. 2020: keep the
    tokens whose strictly-more-probable mass is below p), then renormalise.
    """
    out = []
    for step, token in enumerate(completion):
        x = logits[step].clone()
        if repetition_penalty != 1.0:
            for seen in set(list(prompt) + list(completion[:step])):
                x[seen] = x[seen] / repetition_penalty if x[seen] > 0 else x[seen] * repetition_penalty
        x = x / temperature
        if min_p > 0:
            p = torch.softmax(x, -1)
            x[p < min_p * p.max()] = float("-inf")
        if top_k > 0:
            kth = torch.sort(x, descending=True).values[top_k - 1]
            x[x < kth] = float("-inf")
        if top_p < 1.0:
            p = torch.softmax(x, -1)
            order = torch.argsort(p, descending=True)
            mass_above = torch.cumsum(p[order], 0) - p[order]
            drop = order[mass_above >= top_p]
            x[drop] = float("-inf")
        out.append(torch.log_softmax(x, -1)[token])
    return torch.stack(out)


def engine_child(spec, frozen_store, trainable_store, gen_config, requests, results) -> None:
    """Body of a daemonic spawned child hosting a `VLLMBackend`, as the generation process does: answers
    (min_version, prompts, seed) requests with (version, completion ids, behaviour log-probs) until it gets None."""
    import multiprocessing
    import os
    import traceback

    import psutil

    from trl_async.rollout.backends.vllm import VLLMBackend

    beats = [0]

    def beat():
        beats[0] += 1

    backend = VLLMBackend(
        BackendContext(spec, frozen_store, trainable_store, gen_config, 1.0, [EOS], PAD, heartbeat=beat)
    )
    try:
        version = backend.load()
        # The child is daemonic: vLLM must have started no process of its own.
        children = len(multiprocessing.active_children()) + len(psutil.Process(os.getpid()).children())
        results.put(("ready", version, children))
        while (request := requests.get()) is not None:
            min_version, prompts, seed = request
            trainable_store.wait_for_version(min_version, timeout=120)
            version = backend.update_weights()
            ids, logps = backend.generate(prompts, seed=seed).to_lists()
            results.put(("batch", version, ids, logps, beats[0]))
    except BaseException:
        results.put(("error", traceback.format_exc()))
    finally:
        backend.close()


@torch.no_grad()
def engine_sequence_logprobs(backend, sequences: list[list[int]]) -> list[list[float]]:
    """log p(token_t | tokens_<t), t >= 1, of fixed sequences under a `VLLMBackend` engine's current weights (and
    adapter): vLLM's prompt log-probs (no temperature or filters), i.e. what a trainer's forward at temperature 1
    computes. The check that a weight sync reached the engine."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = backend.llm.generate(
        [{"prompt_token_ids": list(map(int, s))} for s in sequences],
        params,
        lora_request=backend.lora_request,
        use_tqdm=False,
    )
    return [
        [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
        for out, seq in zip(outputs, sequences, strict=True)
    ]
