"""The bundled tiny Qwen2 model used by tests, examples and CPU smoke runs.

``tiny_qwen2/`` holds a ~1.0 M-parameter ``Qwen2ForCausalLM`` and a byte-level BPE tokenizer (every digit
is one token, ChatML chat template, EOS ``<|im_end|>``), trained from scratch by
``python -m trl_async.toy.build`` on the arithmetic problems of :func:`trl_async.toy.make_arithmetic_dataset`
and stopped early, while its held-out greedy accuracy is still low (20-45 %), so that RL has headroom.
It loads offline: ``AutoModelForCausalLM.from_pretrained(tiny_model_path())``.
"""

from __future__ import annotations

import os

__all__ = ["tiny_model_path", "greedy_accuracy", "sampled_accuracy", "generate_completions"]

_TINY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_qwen2")


def tiny_model_path() -> str:
    """Absolute path of the bundled tiny model folder (loadable with ``from_pretrained``)."""
    return _TINY_DIR


def _prompts_and_answers(dataset) -> tuple[list, list[str]]:
    if hasattr(dataset, "column_names"):
        return list(dataset["prompt"]), [str(a) for a in dataset["answer"]]
    rows = list(dataset)
    return [r["prompt"] for r in rows], [str(r["answer"]) for r in rows]


def generate_completions(
    model,
    tokenizer,
    prompts: list,
    max_new_tokens: int = 40,
    batch_size: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
    seed: int | None = None,
) -> list[str]:
    """Generate completions for conversational (or plain-text) prompts, batched with left padding.

    Returns ``len(prompts) * num_return_sequences`` decoded completions (special tokens skipped), the
    samples of one prompt next to each other. Sampling, when asked for, is pure temperature sampling
    (``top_k=0``, ``top_p=1``), like RL rollouts at that temperature.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    texts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if not isinstance(p, str) else p
        for p in prompts
    ]
    gen_kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=num_return_sequences,
    )
    if do_sample:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
                enc = {k: v.to(model.device) for k, v in enc.items()}
                gen = model.generate(**enc, **gen_kwargs)
                new = gen[:, enc["input_ids"].shape[1] :]
                out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, dataset, max_new_tokens: int = 40, batch_size: int = 256) -> float:
    """Fraction of ``dataset`` rows whose greedy completion's ``#### <answer>`` equals the gold ``answer``.

    ``dataset`` has a conversational ``prompt`` column and a string ``answer`` column (as produced by
    :mod:`trl_async.data`). Generation is batched with left padding.
    """
    from ..data import extract_gsm8k_answer

    prompts, answers = _prompts_and_answers(dataset)
    if not prompts:
        raise ValueError("greedy_accuracy needs a non-empty dataset.")
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    correct = sum(extract_gsm8k_answer(c) == a for c, a in zip(completions, answers, strict=True))
    return correct / len(answers)


def sampled_accuracy(
    model,
    tokenizer,
    dataset,
    temperature: float = 1.0,
    num_samples: int = 4,
    max_new_tokens: int = 40,
    batch_size: int = 256,
    seed: int = 0,
) -> float:
    """Mean accuracy of ``num_samples`` temperature samples per row (pure sampling, no top-k/top-p)."""
    from ..data import extract_gsm8k_answer

    prompts, answers = _prompts_and_answers(dataset)
    if not prompts:
        raise ValueError("sampled_accuracy needs a non-empty dataset.")
    completions = generate_completions(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=max(1, batch_size // num_samples),
        do_sample=True,
        temperature=temperature,
        num_return_sequences=num_samples,
        seed=seed,
    )
    gold = [a for a in answers for _ in range(num_samples)]
    correct = sum(extract_gsm8k_answer(c) == a for c, a in zip(completions, gold, strict=True))
    return correct / len(gold)
